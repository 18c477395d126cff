"""Triton gated activations: one pass reading gate and up, writing act(gate) * up rounded once
(act: SiLU, or GELU with the tanh approximation for GeGLU)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr,
                         GELU_TANH: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3): no tanh needed.
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        y = gate / (1.0 + tl.exp(-2.0 * u)) * up
    else:
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None,
                        gelu_tanh: bool = False) -> torch.Tensor:
    """x: [..., 2*I] with gate then up halves -> [..., I]; gelu_tanh: GeGLU's activation instead of SiLU."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0] == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, out2, inter, x2.stride(0), out2.stride(0), BLOCK=block, GELU_TANH=gelu_tanh,
        num_warps=4)
    return out


def gelu_tanh_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2*I] with gate then up halves -> [..., I]: gelu_tanh(gate) * up."""
    return silu_and_mul_triton(x, out=out, gelu_tanh=True)
