"""Allocator over the slots of the state pool: a sequence leases one slot for its life (no sharing)."""
from __future__ import annotations

from collections import deque


class NoFreeSlots(RuntimeError):
    pass


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._leased: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeSlots(f"all {self.num_slots} state slots are leased")
        slot = self._free.popleft()
        self._leased.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._leased:
            raise AssertionError(f"double free of state slot {slot}")
        self._leased.remove(slot)
        self._free.append(slot)
