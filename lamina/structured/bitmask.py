"""The step's token bitmask: filled on the host (pinned, reused), sent in one non-blocking copy, and applied
to the logits on the device (bit t of row r set: token t allowed).

Layout as xgrammar's: int32 [rows, ceil(vocab / 32)], token t in word t // 32, bit t % 32.
"""
from __future__ import annotations

import torch

ALL_ALLOWED = -1  # every bit set


def bitmask_width(vocab: int) -> int:
    return (vocab + 31) // 32


class BitmaskBuffers:
    """Two pinned host buffers used in turn, so filling one never races the copy of the other still in
    flight; grown (never shrunk) to the largest step seen."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.width = bitmask_width(vocab)
        self.device = device
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def host(self, rows: int) -> torch.Tensor:
        """A host view [rows, width] set to all allowed, to be filled by the caller."""
        self._turn ^= 1
        buf = self._bufs[self._turn]
        if buf is None or buf.shape[0] < rows:
            pin = self.device.type == "cuda"
            buf = torch.empty((max(rows, 8), self.width), dtype=torch.int32, pin_memory=pin)
            self._bufs[self._turn] = buf
        view = buf[:rows]
        view.fill_(ALL_ALLOWED)
        return view

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets logits[r, t] = -inf where bit t of bitmask row r is clear, in place (logits [R, V] float, bitmask
    [R, ceil(V / 32)] int32 on the same device). No host sync. On the CPU xgrammar's own kernel (2.6x the
    tensor ops below at 64 x 151,936, which unpack every word into 32 int32s); elsewhere the tensor ops
    (tens of microseconds on a GPU, nothing to compile)."""
    rows, vocab = logits.shape
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        try:
            import xgrammar as xg
        except ImportError:
            xg = None
        if xg is not None:
            xg.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
            return
    apply_bitmask_tensor_ops(logits, bitmask)


def apply_bitmask_tensor_ops(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """apply_bitmask with plain tensor ops (any device)."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(rows, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
