"""Triton grouped gated RMSNorm: one program per (row, group), fp32 math, y and z read once per pass.

A group wider than one tile (Bamba: 8192 channels in one group) is walked twice: the first pass sums the
squares of y * silu(z), the second recomputes it, normalizes and writes. Rounding as the reference: the
normalized value is rounded to the output dtype before the weight multiply, which rounds again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 2048


@triton.jit(do_not_specialize=["n_rows"])
def _grouped_gated_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, n_rows, stride_y, stride_z, stride_o, eps,
                               GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = tl.program_id(1) * GROUP
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, GROUP, BLOCK):
        cols = base + start + offs
        mask = start + offs < GROUP
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        h = y * (z * tl.sigmoid(z))
        acc += h * h
    rstd = tl.math.rsqrt(tl.sum(acc, 0) / GROUP + eps)
    for start in range(0, GROUP, BLOCK):
        cols = base + start + offs
        mask = start + offs < GROUP
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        h = y * (z * tl.sigmoid(z))
        n = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (w * n).to(out_ptr.dtype.element_ty), mask=mask)


def grouped_gated_rms_norm_triton(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                                  eps: float, *, block: int | None = None) -> torch.Tensor:
    """Same contract as grouped_gated_rms_norm_ref; block overrides the tile width (tests)."""
    t, width = y.shape
    assert width % group_size == 0 and z.shape == y.shape and weight.shape == (width,)
    if y.stride(-1) != 1:
        y = y.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty((t, width), dtype=y.dtype, device=y.device)
    if t == 0:
        return out
    bl = block or min(triton.next_power_of_2(group_size), MAX_BLOCK)
    warps = 4 if bl <= 1024 else 8
    _grouped_gated_norm_kernel[(t, width // group_size)](y, z, weight, out, t, y.stride(0), z.stride(0),
                                                         out.stride(0), float(eps), GROUP=group_size, BLOCK=bl,
                                                         num_warps=warps)
    return out
