"""The state pool: per-sequence state of the layers that keep a fixed-size one (recurrent state such as the
gated delta net's conv window + recurrent state), one allocation per declared tensor of each layer, allocated
once at start-up and leased a slot per sequence.

A sequence holds one slot for its whole life (the same index in every layer) and gives it back on every exit
path; the scheduler does both, next to block allocation. Slot addresses never move, which is what a CUDA
graph needs. One extra slot past the leasable ones is never leased: padded rows of a captured batch can
point at it and scribble freely.

What each tensor holds and in which dtype is the layer's spec (e.g. the gated delta net keeps its recurrent
state in fp32 whatever the model dtype); the pool only allocates rows of it. The engine binds `views` into
the layers (StateLayout.bind_slots).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from lamina.cache.slot_allocator import SlotAllocator
from lamina.cache.specs import SlotRows, SlotSpec

log = logging.getLogger("lamina")


class StatePool:
    """num_slots leasable slots (+1 padding slot) of every spec."""

    def __init__(self, specs: list[SlotSpec], num_slots: int, device: torch.device) -> None:
        if not specs:
            raise ValueError("no layer declared per-sequence state")
        self.specs = list(specs)
        self.num_slots = num_slots
        self.padding_slot = num_slots  # never leased
        self.allocator = SlotAllocator(num_slots)
        self.views: list[SlotRows] = [s.allocate(num_slots + 1, device) for s in self.specs]
        # Tensor parallelism: every copy made outside a forward (this one, snapshot saves and restores) is told
        # to the listener, which replays it on the other ranks (lamina/parallel/state_ops.py). None: one process.
        self.copy_listener: Callable[[str, int, int], None] | None = None
        # Per-slot state is large for big hybrids (Qwen3-Next-80B: ~77 MB), so max_num_seqs sets real memory.
        log.info("state pool: %d slots x %d layers = %.2f GiB", num_slots + 1, len(self.specs),
                 (num_slots + 1) * self.bytes_per_slot(self.specs) / 2**30)

    @property
    def tensors(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, its state tensors in declaration order (tests, debugging)."""
        return [v.as_tuple() for v in self.views]

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @staticmethod
    def bytes_per_slot(specs: list[SlotSpec]) -> int:
        return sum(s.bytes_per_slot for s in specs)

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot dst <- slot src in every layer, stream-ordered (e.g. forking candidate states of a sequence
        for speculative decoding: each candidate leases its own slot)."""
        for v in self.views:
            v.copy_row(dst, v, src)
        self.notify_copy("slot", src, dst)

    def notify_copy(self, kind: str, src: int, dst: int) -> None:
        """kind: "slot" (slot src -> slot dst), "save" (slot src -> snapshot dst), "restore" (snapshot src ->
        slot dst)."""
        if self.copy_listener is not None:
            self.copy_listener(kind, src, dst)
