"""One host-to-device copy per step: the step's input arrays packed back to back into a staging buffer.

The runner adds typed numpy arrays (token ids, positions, slots, offsets, sampling parameters, ...) one
after the other at 16-byte aligned offsets (Triton specializes a kernel on whether each pointer argument is
16-byte aligned: views at 8-byte offsets flip that per step and recompile the kernels); ship() copies the used
bytes into a persistent device buffer with
one copy and returns a typed view of it per array. On CUDA the host buffers are pinned and the copy is
non_blocking; there are two of them, used in turn, each with an event marking when its last copy ran, so
writing step N+1's inputs never races the still-queued copy of step N (step N-1's copy is long done by then,
so the wait is free). The returned views alias the device buffer: they are valid until the next ship()'s
copy runs, which on the device is after everything queued before it (one stream), i.e. this step's work.
"""
from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16
_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32,
          np.dtype(np.bool_): torch.bool}


class StepStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._dev: torch.Tensor | None = None
        self._turn = 0
        self._parts: list[tuple[int, np.ndarray]] = []
        self._size = 0

    def add(self, array: np.ndarray) -> int:
        """Queues an array for this step's copy; returns its index in ship()'s list."""
        if array.dtype not in _TORCH:
            raise TypeError(f"staging takes int64/int32/float32/bool arrays, got {array.dtype}")
        off = -(-self._size // _ALIGN) * _ALIGN
        self._parts.append((off, np.ascontiguousarray(array)))
        self._size = off + array.nbytes
        return len(self._parts) - 1

    def _capacity(self, n: int) -> None:
        cap = self._dev.shape[0] if self._dev is not None else 0
        if n <= cap:
            return
        cap = max(n, 2 * cap, 1 << 16)
        self._dev = torch.empty(cap, dtype=torch.uint8, device=self.device)
        for i in range(2):
            if self._events[i] is not None:
                self._events[i].synchronize()
            self._host[i] = torch.empty(cap, dtype=torch.uint8, pin_memory=self.cuda)
            self._events[i] = None

    def ship(self) -> list[torch.Tensor]:
        """Copies everything added since the last ship() to the device in one copy; device views in order."""
        n = max(self._size, _ALIGN)
        self._capacity(n)
        turn = self._turn
        self._turn ^= 1
        if self._events[turn] is not None:
            self._events[turn].synchronize()  # that buffer's previous copy (two steps ago) has run
        host = self._host[turn]
        flat = host.numpy()
        for off, arr in self._parts:
            flat[off:off + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        dev = self._dev
        dev[:n].copy_(host[:n], non_blocking=self.cuda)
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[turn] = event
        views = [dev[off:off + arr.nbytes].view(_TORCH[arr.dtype]).view(arr.shape) for off, arr in self._parts]
        self._parts, self._size = [], 0
        return views
