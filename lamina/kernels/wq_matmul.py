"""Weight-quantized matmul: y = x W^T with W stored as small integers in groups along K.

One storage layout serves every weight-only format (GGUF blocks, GPTQ, AWQ, compressed-tensors int4), each
repacked into it at load time:

- `qweight`: 4 bits: uint8 [N, K/2], element 2j in the low nibble of byte j, 2j+1 in the high one;
  8 bits: int8 [N, K] (signed or not is the format's business: the value is what the scale multiplies).
- `scales`, `offsets`: fp16 [N, K/group]; the weight is W[n, k] = q[n, k] * scales[n, k // group]
  + offsets[n, k // group]. (GPTQ's s * (q - z) is q * s - s * z; GGUF Q4_1's d * q + m is itself; the
  K-quants' d * sc * q - dmin * m too. fp16 holds the products to 2^-11 relative, far below a 4-bit step.)

`dequantize` is the reference (and the test oracle); `wq_linear` dispatches: the Triton kernels on CUDA
(wq_dispatch.py picks triton_wq_matmul.py's or the repacked triton_wq_gemv_kn.py's per M, dequantizing in
registers), torch's packed int4 CPU matmul for 4-bit weights on the CPU (`CpuInt4Pack`, prepared once
after loading; 8-bit weights as two of them, `CpuInt8Split`), and dequantize + F.linear otherwise.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lamina.kernels.dispatch import use_triton

# Group sizes torch's CPU int4 kernel takes (it tiles K by the group).
CPU_INT4_GROUPS = (32, 64, 128, 256)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] (values 0..15), in the layout's order."""
    lo, hi = qweight & 0xF, qweight >> 4
    return torch.stack([lo, hi], dim=-1).reshape(qweight.shape[0], -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers 0..15 -> uint8 [N, K/2] (inverse of unpack_int4)."""
    q = q.to(torch.uint8).reshape(q.shape[0], -1, 2)
    return q[..., 0] | (q[..., 1] << 4)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight in `dtype` (computed in fp32)."""
    q = unpack_int4(qweight) if bits == 4 else qweight
    n, groups = scales.shape
    w = q.reshape(n, groups, -1).float()  # broadcast the group's scale and offset (no repeated copies)
    w.mul_(scales.float()[..., None]).add_(offsets.float()[..., None])
    return w.reshape(n, -1).to(dtype)


def dequantize_rows(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                    ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (any shape) of the weight: an embedding lookup that touches only those rows."""
    flat = ids.reshape(-1)
    rows = dequantize(qweight[flat], scales[flat], offsets[flat], bits, dtype)
    return rows.view(*ids.shape, rows.shape[-1])


@dataclass
class CpuInt4Pack:
    """A 4-bit weight in the layout of torch's CPU int4 matmul (`_weight_int4pack_mm_for_cpu`), which
    computes W = (q - 8) * scale + zero with bf16 scale/zero per group and bf16 activations: so zero =
    offset + 8 * scale. Only the scales and offsets are rounded to bf16 (2^-9 relative)."""

    packed: torch.Tensor  # uint8, torch's own tiling
    scale_zeros: torch.Tensor  # bf16 [K/group, N, 2]
    group: int

    @classmethod
    def build(cls, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> CpuInt4Pack:
        # numpy: torch's uint8 arithmetic is ~15x slower on the CPU, and this runs once per layer at load.
        b = qweight.numpy()
        q = torch.from_numpy(np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1).astype(np.int32))
        s = scales.float()
        return cls.from_nibbles(q, s, offsets.float() + 8 * s)

    @classmethod
    def from_nibbles(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> CpuInt4Pack:
        """q: int32 [N, K] values 0..15; scale, zero: fp32 [N, K/group]; W = (q - 8) * scale + zero."""
        group = q.shape[1] // scale.shape[1]
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return cls(torch._convert_weight_to_int4pack_for_cpu(q, 1), sz, group)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] (any float dtype) -> [M, N] in x2's dtype."""
        xb = x2.to(torch.bfloat16)
        y = self.matmul_bf16(xb if xb.is_contiguous() else xb.contiguous())
        return y if x2.dtype == torch.bfloat16 else y.to(x2.dtype)

    def matmul_bf16(self, xb: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(xb, self.packed, self.group, self.scale_zeros)


@dataclass
class CpuInt8Split:
    """An 8-bit weight (GGUF Q8_0, the built-in model's tied lm_head) as two 4-bit packs for torch's CPU int4
    matmul, which has no grouped int8 sibling: q = 16 * (q >> 4) + (q & 15), so W = q * s + o is
    (hi + 8 - 8) * 16s + (lo - 8) * s + (8s + o) with hi = q >> 4 in -8..7 and lo = q & 15. Exact but for the
    scales' bf16 rounding (as CpuInt4Pack; 16s and 8s round like s), and it reads 1 byte per weight where the
    bf16 copy it replaces read 2: 1.7 vs 2.8 ms for SmolLM2's 49152 x 576 lm_head at 2 threads here."""

    hi: CpuInt4Pack
    lo: CpuInt4Pack

    @classmethod
    def build(cls, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> CpuInt8Split:
        q = qweight.numpy().astype(np.int32)
        s, o = scales.float(), offsets.float()
        hi = CpuInt4Pack.from_nibbles(torch.from_numpy((q >> 4) + 8), 16 * s, torch.zeros_like(s))
        lo = CpuInt4Pack.from_nibbles(torch.from_numpy(q & 15), s, o + 8 * s)
        return cls(hi, lo)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        xb = x2.to(torch.bfloat16).contiguous()
        y = self.hi.matmul_bf16(xb).float().add_(self.lo.matmul_bf16(xb))  # the sum in fp32
        return y.to(x2.dtype)


def cpu_int4_ok(qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> bool:
    """Whether this weight can use torch's CPU int4 matmul (8 bits: as a CpuInt8Split)."""
    if bits not in (4, 8) or qweight.is_cuda or scales.shape[1] == 0:
        return False
    k = qweight.shape[1] * (8 // bits)
    group = k // scales.shape[1]
    # The packing tiles N by 16 (it refuses other widths with an error: such a weight keeps the fallback).
    return group in CPU_INT4_GROUPS and k % group == 0 and qweight.shape[0] % 16 == 0 \
        and hasattr(torch, "_weight_int4pack_mm_for_cpu")


def kn_wanted(qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> bool:
    """Whether the format's finish_loading builds the repacked decode-GEMV copy: LAMINA_WQ_GEMV=repack, a
    4-bit CUDA weight, K whole words and groups of a multiple of 8 columns (GPTQ/AWQ/CT g128, GGUF g32)."""
    if os.environ.get("LAMINA_WQ_GEMV", "") != "repack" or bits != 4 or not qweight.is_cuda:
        return False
    groups, k = scales.shape[1], qweight.shape[1] * 2
    return groups > 0 and k % 8 == 0 and k % groups == 0 and (k // groups) % 8 == 0


def wq_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
              bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
              cpu_pack: CpuInt4Pack | CpuInt8Split | None = None, cpu_dense: torch.Tensor | None = None,
              kn=None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype.

    perm: input-column order of the stored weight (act-order GPTQ stores columns sorted by group; the
    activations are gathered to match). cpu_pack / cpu_dense: prepared CPU forms (see the format's
    finish_loading); without them the CPU dequantizes on every call (the reference). kn: the repacked
    decode-GEMV copy (triton_wq_gemv_kn.KnWeight). On CUDA wq_dispatch picks the kernel per M (its table)."""
    if perm is not None:
        x = x.index_select(-1, perm)
    # 2-D x (every decode step's): no reshape or view, each an aten call of ~1 us on the CPU's per-op path
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if use_triton(x2) and x2.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from lamina.kernels.wq_dispatch import process_dispatcher

        y = process_dispatcher()(x2, qweight, scales, offsets, bits, kn)
    elif cpu_pack is not None:
        y = cpu_pack.matmul(x2)
    elif cpu_dense is not None:
        y = F.linear(x2.to(cpu_dense.dtype), cpu_dense).to(x2.dtype)
    else:
        y = F.linear(x2, dequantize(qweight, scales, offsets, bits, x2.dtype))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
