"""Triton RMSNorm and fused residual-add + RMSNorm: one read and one write per tensor, fp32 math.

Rows shorter than 2048 elements (per-head q/k norms) are packed several to a program so that small rows
still fill a program's warps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_rows"])  # the token count changes every step
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, n_rows, n_cols,
                     stride_x, stride_r, stride_o, stride_s, eps, offset,
                     BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the stream dtype first: the reference normalizes the rounded sum it returns.
        summed = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows[:, None] * stride_s + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    y = (x * rstd[:, None]) * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    # A 2-D view with unit column stride; copies only when the rows cannot be described by one stride.
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x2, r2, weight, out2, sum2, eps, offset, has_res):
    n_rows, n_cols = x2.shape
    if n_rows == 0:
        return
    block_n = triton.next_power_of_2(n_cols)
    rows = max(1, min(64, 2048 // block_n))
    warps = 4 if block_n * rows <= 2048 else (8 if block_n <= 8192 else 16)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x2, r2, weight, out2, sum2, n_rows, n_cols, x2.stride(0), r2.stride(0), out2.stride(0), sum2.stride(0),
        float(eps), float(offset), BLOCK_N=block_n, ROWS=rows, HAS_RES=has_res, num_warps=warps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                    *, out: torch.Tensor | None = None) -> torch.Tensor:
    x2 = _rows(x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.is_contiguous()
    out2 = out.view(-1, x.shape[-1])
    _launch(x2, x2, weight, out2, out2, eps, offset, False)
    return out


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              offset: float = 0.0, *, out: torch.Tensor | None = None,
                              sum_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors; the inputs are left untouched.

    Writing in place would move the same bytes (read two, write two), so fresh outputs cost nothing extra
    and spare callers from aliasing surprises. Pass out=x, sum_out=residual to write in place.
    """
    dtype = torch.result_type(x, residual)
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    assert tuple(x.shape) == tuple(shape) and tuple(residual.shape) == tuple(shape)
    x2, r2 = _rows(x), _rows(residual)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=x.device)
    if sum_out is None:
        sum_out = torch.empty(shape, dtype=dtype, device=x.device)
    assert out.is_contiguous() and sum_out.is_contiguous()
    _launch(x2, r2, weight, out.view(-1, shape[-1]), sum_out.view(-1, shape[-1]), eps, offset, True)
    return out, sum_out


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_gated_kernel(x_ptr, g_ptr, w_ptr, out_ptr, n_rows, n_heads, n_cols, stride_xt, stride_xh,
                           stride_gt, stride_gh, eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    tok, head = rows // n_heads, rows % n_heads
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + (tok * stride_xt + head * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    g = tl.load(g_ptr + (tok * stride_gt + head * stride_gh)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    # Rounded where the reference rounds: normalized x to x's dtype, times the weight in that dtype.
    y = ((xf * rstd[:, None]).to(x.dtype) * w[None, :].to(x.dtype)).to(tl.float32)
    out = y * (g * tl.sigmoid(g))
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_gated_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight * silu(gate) per head. x, gate: [T, H, D] (any token and head strides, unit
    column stride: the gate is a view into the layer's projection output) -> a new contiguous [T, H, D]."""
    assert x.dim() == 3 and gate.shape == x.shape and x.stride(-1) == 1 and gate.stride(-1) == 1
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    n_rows = t * h
    if n_rows == 0:
        return out
    block_n = triton.next_power_of_2(d)
    rows = max(1, min(64, 2048 // block_n))
    _rms_norm_gated_kernel[(triton.cdiv(n_rows, rows),)](
        x, gate, weight, out, n_rows, h, d, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), float(eps),
        BLOCK_N=block_n, ROWS=rows, num_warps=4)
    return out
