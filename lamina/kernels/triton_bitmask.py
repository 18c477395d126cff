"""Structured output's token bitmask applied to float logits on the device in one Triton launch (the torch
path it replaces unpacks the bits with ~6 kernels and as many host dispatches per step: arange, shift, and,
bool, not, masked_fill or where).

Bitmask layout as xgrammar's: int32 [N, ceil(vocab / 32)], bit t % 32 of word t // 32 set: token t allowed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # tokens per program: 128 words of the mask, 16 KB of float32 logits


@triton.jit
def _bitmask_kernel(src_ptr, dst_ptr, mask_ptr, rows_ptr, vocab, stride_src, stride_dst, stride_mask,
                    HAS_ROWS: tl.constexpr, COPY: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    words = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(mask_ptr + i.to(tl.int64) * stride_mask + words, mask=words < (vocab + 31) // 32, other=-1)
    bits = (packed[:, None] >> tl.arange(0, 32)[None, :]) & 1  # arithmetic shift: bit 31 is still & 1
    allowed = tl.reshape(bits, (BLOCK,)) != 0  # row-major: element (w, b) is token w * 32 + b
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    if COPY:  # dst = src masked: every token read and written once
        x = tl.load(src_ptr + row * stride_src + cols, mask=inside)
        tl.store(dst_ptr + row * stride_dst + cols, tl.where(allowed, x, float("-inf")), mask=inside)
    else:  # in place: only the banned tokens are written
        tl.store(dst_ptr + row * stride_dst + cols, tl.full((BLOCK,), float("-inf"), tl.float32)
                 .to(dst_ptr.dtype.element_ty), mask=inside & ~allowed)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask row i is clear, in place (rows None: row i is logits row
    i, every row). logits [R, V] with unit stride along V; bitmask int32 [N, >= ceil(V / 32)]; rows int64 [N];
    all on one device."""
    n = bitmask.shape[0] if rows is None else rows.shape[0]
    if n == 0:
        return
    _launch(logits, logits, bitmask, rows, n, copy=False)


def masked_copy_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A new tensor: logits with every row i masked by bitmask row i (bitmask has logits' row count)."""
    out = torch.empty_like(logits)
    if logits.shape[0]:
        _launch(logits, out, bitmask, None, logits.shape[0], copy=True)
    return out


def _launch(src: torch.Tensor, dst: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, n: int,
            copy: bool) -> None:
    vocab = src.shape[1]
    assert src.stride(1) == 1 and dst.stride(1) == 1 and bitmask.stride(1) == 1, "unit stride along the vocab"
    assert bitmask.dtype == torch.int32 and bitmask.shape[1] * 32 >= vocab
    _bitmask_kernel[(n, triton.cdiv(vocab, BLOCK))](
        src, dst, bitmask, rows if rows is not None else bitmask, vocab, src.stride(0), dst.stride(0),
        bitmask.stride(0), HAS_ROWS=rows is not None, COPY=copy, BLOCK=BLOCK, num_warps=4)
