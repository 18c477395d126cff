"""The state pool: per-sequence state of the layers that keep one (gated delta net: conv window + recurrent
state), one allocation per layer, allocated once at start-up and leased a slot per sequence.

A sequence holds one slot for its whole life (the same index in every layer) and gives it back on every exit
path; the scheduler does both, next to block allocation. Slot addresses never move, which is what a CUDA
graph needs. One extra slot past the leasable ones is never leased: padded rows of a captured batch can
point at it and scribble freely.

Recurrent states are kept in fp32 whatever the model dtype: they integrate over the whole sequence, and HF's
and fla's kernels carry them in fp32 too. Conv states hold raw inputs and use the model dtype.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from lamina.cache.slot_allocator import SlotAllocator
from lamina.models.layers.gated_delta_net import GatedDeltaNet

STATE_DTYPE = torch.float32
log = logging.getLogger("lamina")


def state_layers(model: nn.Module) -> list[GatedDeltaNet]:
    return [m for m in model.modules() if isinstance(m, GatedDeltaNet)]


class StatePool:
    """num_slots leasable slots (+1 padding slot) in every state layer of `model`, bound into the layers."""

    def __init__(self, model: nn.Module, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers = state_layers(model)
        if not self.layers:
            raise ValueError("the model has no layers with per-sequence state")
        self.num_slots = num_slots
        self.padding_slot = num_slots  # never leased
        self.allocator = SlotAllocator(num_slots)
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in self.layers:
            conv_shape, ssm_shape = layer.state_shapes()
            conv = torch.zeros((num_slots + 1, *conv_shape), dtype=dtype, device=device)
            ssm = torch.zeros((num_slots + 1, *ssm_shape), dtype=STATE_DTYPE, device=device)
            layer.conv_state, layer.ssm_state = conv, ssm
            self.tensors.append((conv, ssm))
        # Per-slot state is large for big hybrids (Qwen3-Next-80B: ~77 MB), so max_num_seqs sets real memory.
        log.info("state pool: %d slots x %d layers = %.2f GiB", num_slots + 1, len(self.layers),
                 (num_slots + 1) * self.bytes_per_slot(model, dtype) / 2**30)

    @classmethod
    def for_model(cls, model: nn.Module, num_slots: int, dtype: torch.dtype,
                  device: torch.device) -> "StatePool | None":
        """A pool when the model has state layers, else None (pure-attention models need none)."""
        return cls(model, num_slots, dtype, device) if state_layers(model) else None

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @staticmethod
    def bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        state_item = torch.empty((), dtype=STATE_DTYPE).element_size()
        total = 0
        for layer in state_layers(model):
            (c, k), (h, dk, dv) = layer.state_shapes()
            total += c * k * item + h * dk * dv * state_item
        return total
