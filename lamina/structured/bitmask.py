"""The step's token bitmask: filled on the host (pinned, reused), sent in one non-blocking copy, and applied
to the logits on the device (bit t of row r set: token t allowed).

Layout as xgrammar's: int32 [rows, ceil(vocab / 32)], token t in word t // 32, bit t % 32.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

ALL_ALLOWED = -1  # every bit set


def bitmask_width(vocab: int) -> int:
    return (vocab + 31) // 32


class BitmaskBuffers:
    """Two pinned host buffers used in turn, so filling one never races the copy of the other still in
    flight; grown (never shrunk) to the largest step seen. Each turn has a row-index buffer too (which
    logits rows the bitmask rows belong to)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.width = bitmask_width(vocab)
        self.device = device
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._rows: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def host(self, rows: int, blank: bool = True) -> torch.Tensor:
        """A host view [rows, width] set to all allowed (blank=False: left as it was, for a caller that writes
        every row), to be filled by the caller."""
        self._turn ^= 1
        buf = self._bufs[self._turn]
        if buf is None or buf.shape[0] < rows:
            pin = self.device.type == "cuda"
            buf = torch.empty((max(rows, 8), self.width), dtype=torch.int32, pin_memory=pin)
            self._bufs[self._turn] = buf
        view = buf[:rows]
        if not blank:
            return view
        # numpy's fill is one plain memset. torch's fill_ splits a 1.2 MB buffer over its intra-op threads,
        # which the grammar fill's threads keep busy: 5.3 ms per step at 64 rows on the H200 host
        # (scripts/gpu_vllm.sh structured, BENCHMARKS.md), against tens of microseconds for the memset.
        view.numpy().fill(ALL_ALLOWED)
        return view

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def rows_to_device(self, rows: list[int]) -> torch.Tensor:
        """rows as an int64 tensor on the device, through this turn's pinned buffer (one non-blocking copy)."""
        buf = self._rows[self._turn]
        if buf is None or buf.shape[0] < len(rows):
            buf = torch.empty(max(len(rows), 8), dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self._rows[self._turn] = buf
        view = buf[:len(rows)]
        view.copy_(torch.tensor(rows, dtype=torch.int64))
        return view.to(self.device, non_blocking=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Sets logits[rows[i], t] = -inf where bit t of bitmask row i is clear, in place (logits [R, V] float,
    bitmask [N, ceil(V / 32)] int32 on the same device; rows: int64 [N] on that device, None: N = R and row
    i is logits row i). On the CPU apply_bitmask_sparse (xgrammar's kernel where a row mostly allows); on
    CUDA one Triton launch (kernels/triton_bitmask.py); else byte-wise tensor ops. No host sync off the CPU."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and _has_xgrammar():
        apply_bitmask_sparse(logits, bitmask, rows)
        return
    if _use_triton(logits):
        from lamina.kernels.triton_bitmask import apply_bitmask_triton

        apply_bitmask_triton(logits, bitmask, rows)
        return
    if rows is None:
        logits.masked_fill_(~allowed_tokens(bitmask, logits.shape[1]), float("-inf"))
    else:
        sub = logits.index_select(0, rows)
        sub.masked_fill_(~allowed_tokens(bitmask, logits.shape[1]), float("-inf"))
        logits.index_copy_(0, rows, sub)


def apply_bitmask_sparse(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """apply_bitmask on the CPU (float32, xgrammar installed), by what each row mostly is (see _sparse)."""
    _sparse(logits, logits, bitmask, rows)


def _sparse(dst: torch.Tensor, src: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """dst = src masked (dst is src: in place; else dst is a fresh tensor of src's shape, and unmasked rows
    are copied). A grammar's mask nearly always mostly allows (inside a string) or mostly bans (structure,
    digits). xgrammar's CPU kernel skips all-ones words, so it is nearly free on the first kind, but writes
    every banned token one at a time on the second (1.6 ms per row of 151,936 on the loaded development
    machine, more than a small model's forward): those rows are set to -inf at once and get back the
    allowed tokens of their nonzero words (read from src, so a copy never copies them first). Host syncs
    (nonzero) make this CPU-only. rows must be distinct."""
    import xgrammar as xg

    n, vocab = src.shape
    lrows = rows if rows is not None else torch.arange(bitmask.shape[0])
    banned = (bitmask == ALL_ALLOWED).sum(1) < (bitmask == 0).sum(1)
    sel_b = banned.nonzero()[:, 0]
    sel_a = (~banned).nonzero()[:, 0]
    if dst is not src:
        if not sel_b.numel():
            dst.copy_(src)
        else:
            rest = torch.ones(n, dtype=torch.bool)
            rest[lrows.index_select(0, sel_b)] = False
            idx = rest.nonzero()[:, 0]
            if idx.numel():
                dst[idx] = src[idx]
    if sel_a.numel():  # the mostly allowed rows: xgrammar's kernel
        if rows is None and sel_a.numel() == n:
            xg.apply_token_bitmask_inplace(dst, bitmask, vocab_size=vocab)
        else:
            la = lrows.index_select(0, sel_a)
            part = dst.index_select(0, la)
            xg.apply_token_bitmask_inplace(part, bitmask.index_select(0, sel_a), vocab_size=vocab)
            dst.index_copy_(0, la, part)
    if sel_b.numel():  # the mostly banned rows: -inf, then the allowed tokens back
        bits = torch.arange(32, dtype=torch.int32)
        words = bitmask.index_select(0, sel_b)
        r, w = (words != 0).nonzero(as_tuple=True)
        tok = w[:, None] * 32 + bits.long()
        pick = ((words[r, w][:, None] >> bits) & 1).bool() & (tok < vocab)
        lb = lrows.index_select(0, sel_b)
        row = lb[r][:, None].expand_as(tok)[pick]
        tok = tok[pick]
        kept = src[row, tok]
        dst.index_fill_(0, lb, float("-inf"))
        dst[row, tok] = kept


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [N, vocab] of a bitmask [N, ceil(vocab / 32)] int32, unpacked a byte at a time (token t is bit t % 8
    of byte t // 8 of the little-endian words): temporaries of one byte per token, a quarter of what
    unpacking each word into 32 int32s makes."""
    n = bitmask.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bytes_ = bitmask.contiguous().view(torch.uint8)
    return ((bytes_[:, :, None] >> shifts) & 1).view(n, -1)[:, :vocab].bool()


def masked_copy(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of logits with apply_bitmask(copy, bitmask, rows) done, where a clone would be needed anyway (the
    raw logits stay for logprobs): on the device one pass when every row is masked, on the CPU each row
    written once (a clone of 64 x 151,936 float32 cost more than the mask on the development machine)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and _has_xgrammar():
        out = torch.empty_like(logits)
        _sparse(out, logits, bitmask, rows)
        return out
    if rows is None:
        if _use_triton(logits):  # one launch; the tensor ops below are ~6 launches (issue 16: ~200 us a step)
            from lamina.kernels.triton_bitmask import masked_copy_triton

            return masked_copy_triton(logits, bitmask)
        return torch.where(allowed_tokens(bitmask, logits.shape[1]), logits, float("-inf"))
    out = logits.clone()
    apply_bitmask(out, bitmask, rows)
    return out


def warm_up_bitmask(vocab: int, device: torch.device) -> None:
    """Compiles the sampler's bitmask kernels (masked copy, in place over chosen rows) on CUDA at start-up, so
    the first constrained request does not pay Triton's compilation; nothing elsewhere."""
    if torch.device(device).type != "cuda":
        return
    logits = torch.zeros((2, vocab), device=device)
    if not _use_triton(logits):
        return
    bitmask = torch.full((2, bitmask_width(vocab)), ALL_ALLOWED, dtype=torch.int32, device=device)
    masked_copy(logits, bitmask)
    apply_bitmask(logits, bitmask[:1], torch.ones(1, dtype=torch.int64, device=device))


def _use_triton(logits: torch.Tensor) -> bool:
    """The Triton kernel serves CUDA float logits with unit stride along the vocabulary."""
    return (logits.device.type == "cuda" and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and logits.stride(1) == 1 and _has_triton())


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _has_xgrammar() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def apply_bitmask_tensor_ops(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """apply_bitmask over every row with plain tensor ops (any device)."""
    logits.masked_fill_(~allowed_tokens(bitmask, logits.shape[1]), float("-inf"))
