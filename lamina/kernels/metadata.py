"""Per-step metadata beyond attention: where mixers with per-sequence state (gated delta net, conv) find it,
and the step context the model's layers receive (attention metadata + state metadata)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.kernels.attention import AttentionMetadata


@dataclass(frozen=True)
class StateMetadata:
    """State-pool addressing of one step's sequences (row b of the batch = sequence b of AttentionMetadata).

    A sequence whose chunk starts at position 0 (has_initial_state False) starts from a zero state, whatever
    its slot held. GPU kernels read only the device tensors (graph-safe); the references the host lists."""

    slots: torch.Tensor  # [B] int64
    has_initial_state: torch.Tensor  # [B] bool
    slots_cpu: list[int]
    has_initial_state_cpu: list[bool]
    # Verify steps (speculative decoding): per sequence, the slots that receive its state after each token of
    # its chunk but the last (whose state goes to its own slot, as always); None: no sequence verifies.
    candidate_slots_cpu: list[list[int]] | None = None
    # Their device copy [B, max(1, max_query_len - 1)] (row b: its candidates first), when every sequence of the
    # step is a verify chunk or a single token (the Triton verify kernel's case); else None (the reference).
    candidate_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class StepContext:
    """What every layer of one forward gets: attention metadata, and state metadata for models with a state
    pool (None otherwise, or in a profiling pass: zero state, nothing written)."""

    attn: AttentionMetadata
    state: StateMetadata | None = None
