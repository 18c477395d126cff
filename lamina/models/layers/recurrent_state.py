"""The state binding the recurrent mixers share (GatedDeltaNet, Mamba2Mixer): state-pool rows holding a causal
conv's window ("conv") and an fp32 recurrent state ("ssm") per sequence slot."""
from __future__ import annotations

import torch

from lamina.cache.specs import SlotRows


class ConvSsmState:
    """bind_state and the two tensors' views. Unbound (None): zero state, nothing kept."""

    _state: SlotRows | None = None  # bound by the engine (state-pool rows; stable for CUDA graphs)

    def bind_state(self, view: SlotRows) -> None:
        self._state = view

    @property
    def conv_state(self) -> torch.Tensor | None:  # [slots, C, K-1]
        return self._state["conv"] if self._state is not None else None

    @property
    def ssm_state(self) -> torch.Tensor | None:  # fp32: GatedDeltaNet [slots, Hv, dk, dv], Mamba2 [slots, H, P, N]
        return self._state["ssm"] if self._state is not None else None
