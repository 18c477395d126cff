"""FP8 (e4m3) weights: quantize, dequantize, and the linear that reads them.

A weight is stored as float8_e4m3fn [N, K] with fp32 scales that multiply it back (w ~= q * scale):
- per output row (`block=None`): scale [N] (per-tensor checkpoints are expanded to rows at load);
- per (bn x bk) block (`block=(bn, bk)`, the DeepSeek/Qwen fine-grained format): scale [ceil(N/bn), ceil(K/bk)].

`fp8_linear` is the one entry point. The torch reference (CPU, and the oracle) dequantizes the weight to the
activation dtype and calls F.linear: weight-only, no activation rounding. On CUDA:
- M <= 16 rows: the Triton GEMV (triton_fp8_gemv.py) at one row (and off Hopper), the skinny tensor-core GEMM
  (triton_fp8_skinny.py) at 2..16 on Hopper (LAMINA_FP8_SKINNY overrides); both read FP8 and accumulate fp32,
  activations unrounded;
- more rows, block scales: activations quantized per token and per bk-wide group, then the Triton
  block-scaled GEMM on FP8 tensor cores (triton_fp8_gemm.py), or (on Hopper: block_gemm(), 128x128 blocks
  only) torch._scaled_mm's blockwise (1x128 activations, 128x128 weights) scaling;
- more rows, row scales (also what --quantization fp8, online, stores): activations quantized per token (or
  with a static scale), then torch._scaled_mm with row-wise scales, falling back to the reference where its
  shape rules are not met.
The CUDA paths quantize activations with one Triton kernel (triton_fp8_quant.py); quantize_tokens below is
its reference. H200, 8k tokens, one Qwen3-8B layer's four GEMMs (2026-12-02): block GEMM 506 TFLOP/s alone
and 330 with the torch quantization; rows _scaled_mm 671 with it (bf16 799).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from lamina.kernels.dispatch import use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MAX_GEMV_M = 16
# Which 128x128 block-scaled GEMM runs past the GEMV's rows: torch._scaled_mm's blockwise scaling on Hopper
# (measured 2026-12-02 on the H200, scripts/fp8_gpu_bench.py, 8,192 tokens of the Qwen3-8B projections with
# the activation quantization: 1,176 TFLOP/s = 82% of the FP8 peak on qkv, against 506 for the Triton block
# GEMM and 790 for bf16), the Triton GEMM elsewhere (torch refuses blockwise scales off sm90 here).
# LAMINA_FP8_BLOCK_GEMM=triton|scaled_mm overrides.
BLOCK_GEMM_ENV = "LAMINA_FP8_BLOCK_GEMM"
# The skinny tensor-core GEMM (triton_fp8_skinny.py) takes 2..16 rows on Hopper by default: Qwen3-8B's 36 layers
# (H100, 2026-12-07, benchmarks/results/2026-12-07-h100/fp8skinny) 3.68-3.76 ms at M = 2..16 against the GEMV's
# 4.50-5.14 (bf16: 5.24-5.40); one row stays on the GEMV (3.33 ms against the skinny GEMM's 3.71).
# LAMINA_FP8_SKINNY overrides: tc16|tc (2..16 rows on any GPU), "+m1" (tc16+m1) one row too, "off" the GEMV.
SKINNY_ENV = "LAMINA_FP8_SKINNY"
_TINY = 1e-12  # an all-zero row or block gets this scale instead of 0 (0/0 would be NaN)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast: values beyond +-448 clamp (a plain cast would turn them into NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q fp8 [N, K], scale fp32 [N]) with each row's amax mapped to 448."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(_TINY)
    return to_fp8(wf / scale[:, None]), scale


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales [..., ceil(N/bn), ceil(K/bk)] -> one scale per element [..., N, K]."""
    bn, bk = block
    n, k = shape
    return scale.float().repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q fp8 [N, K], scale fp32 [ceil(N/bn), ceil(K/bk)]) with each block's amax mapped to 448."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    amax = padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(_TINY)
    return to_fp8(w.float() / expand_block_scale(scale, (n, k), block)), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., N, K] fp8 with row scales [..., N] or block scales [..., nb, kb] -> the weight in `dtype`."""
    if block is None:
        return (q.float() * scale.float()[..., None]).to(dtype)
    return (q.float() * expand_block_scale(scale, tuple(q.shape[-2:]), block)).to(dtype)


def quantize_tokens(x: torch.Tensor, group: int | None = None,
                    static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] -> (q fp8 [M, K], scale fp32): per token [M, 1] (group None), per token and
    `group`-wide column group [M, ceil(K/group)], or one static scale broadcast to [M, 1]."""
    xf = x.float()
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        return to_fp8(xf / scale), scale
    if group is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
        return to_fp8(xf / scale), scale
    m, k = x.shape
    kb = -(-k // group)
    padded = F.pad(xf, (0, kb * group - k))
    scale = (padded.view(m, kb, group).abs().amax(dim=2) / FP8_MAX).clamp_min(_TINY)
    return to_fp8(xf / scale.repeat_interleave(group, 1)[:, :k]), scale


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(weight)^T (+ bias), in x's dtype."""
    return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype. input_scale: a static activation scale (row-scaled weights only;
    None: dynamic per-token). See the module docstring for which path runs where."""
    if not use_triton(x) or x.dtype not in (torch.bfloat16, torch.float16):
        return fp8_linear_ref(x, weight, scale, block, bias)
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    variant = skinny_variant(m, device=x2.device) if m <= MAX_GEMV_M else None
    if variant:
        from lamina.kernels.triton_fp8_skinny import default_config, fp8_skinny

        n, k = weight.shape
        config = default_config(m, n, k, block, x2.device, variant)
        if block is None or not (block[1] & (block[1] - 1) or block[1] % config.block_k):
            y = fp8_skinny(x2.contiguous(), weight, scale, block, bias, config=config)
        else:  # a scale block width the K steps cannot divide: the GEMV
            from lamina.kernels.triton_fp8_gemv import fp8_gemv

            y = fp8_gemv(x2, weight, scale, block, bias)
    elif m <= MAX_GEMV_M:
        from lamina.kernels.triton_fp8_gemv import fp8_gemv

        y = fp8_gemv(x2, weight, scale, block, bias)
    elif block is not None and block[1] < 32:  # FP8 dots need K tiles >= 32 (real checkpoints use 128)
        return fp8_linear_ref(x, weight, scale, block, bias)
    elif block is not None:
        y = block_scaled_mm(x2, weight, scale, block, bias, block_gemm(x2.device))
    else:
        y = _scaled_mm_rows(x2, weight, scale, bias, input_scale)
    return y.view(*x.shape[:-1], weight.shape[0])


def skinny_variant(m: int, env: str | None = None, device: torch.device | None = None) -> str | None:
    """The skinny GEMM variant for m rows (None: the GEMV): LAMINA_FP8_SKINNY's, else "tc" for 2..16 rows on
    a Hopper GPU (the only one it was timed on)."""
    env = os.environ.get(SKINNY_ENV, "") if env is None else env
    if not env and device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        env = "tc"
    variant, _, rows = env.partition("+")
    if variant not in ("tc", "tc16") or (m == 1 and rows != "m1"):
        return None
    return variant


def _scaled_mm_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    input_scale: torch.Tensor | None) -> torch.Tensor:
    """Row-scaled FP8 GEMM on tensor cores. torch._scaled_mm's row-wise scaling wants bf16 output and sizes
    that are multiples of 16: K and N are checked (else the reference), M is padded with zero rows."""
    n, k = weight.shape
    if k % 16 or n % 16 or x.dtype != torch.bfloat16:
        return fp8_linear_ref(x, weight, scale, None, bias)
    m = x.shape[0]
    if use_triton(x):
        from lamina.kernels.triton_fp8_quant import quantize_tokens_triton

        # M padded to 16 inside the quantization kernel (zero rows), not by two extra F.pad copies
        xq, xs = quantize_tokens_triton(x.contiguous(), static_scale=input_scale, pad_m=16)
    else:
        xq, xs = quantize_tokens(x, static_scale=input_scale)
        if m % 16:
            xq = F.pad(xq.view(torch.uint8), (0, 0, 0, -m % 16)).view(FP8)
            xs = F.pad(xs, (0, 0, 0, -m % 16), value=1.0)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.float().view(1, n), out_dtype=x.dtype)[:m]
    return y if bias is None else y + bias


@functools.cache
def block_gemm(device: torch.device) -> str:
    """Returns "scaled_mm" on sm90, else "triton" (see BLOCK_GEMM_ENV)."""
    choice = os.environ.get(BLOCK_GEMM_ENV)
    if choice in ("triton", "scaled_mm"):
        return choice
    return "scaled_mm" if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0) else "triton"


def block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                    bias: torch.Tensor | None = None, gemm: str = "triton") -> torch.Tensor:
    """x [M, K] (CUDA, bf16/fp16) @ the block-scaled weight: activations quantized per token and bk-wide
    group by the Triton kernel, then gemm "triton" (triton_fp8_gemm) or "scaled_mm" (torch._scaled_mm
    blockwise: 128x128 weight blocks, bf16 out, K and N multiples of 128 as measured; else the Triton GEMM)."""
    from lamina.kernels.triton_fp8_quant import quantize_tokens_triton

    n, k = weight.shape
    if gemm == "scaled_mm" and block == (128, 128) and x.dtype == torch.bfloat16 and not k % 128 and not n % 128:
        xq, xs = quantize_tokens_triton(x.contiguous(), group=128, pad_m=16, scales_m_major=True)
        # scale_b [ceil(K/128), ceil(N/128)] for b = weight^T: the stored [nb, kb] scales transposed (a view)
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.t(), out_dtype=x.dtype)[:x.shape[0]]
        return y if bias is None else y + bias
    from lamina.kernels.triton_fp8_gemm import fp8_block_gemm

    xq, xs = quantize_tokens_triton(x.contiguous(), group=block[1])
    return fp8_block_gemm(xq, xs, weight, scale, block, x.dtype, bias)


MOE_GEMV_PAIRS = 64  # at most this many (token, slot) pairs: the FP8 per-pair GEMVs (as triton_moe's dense ones)


def fp8_fused_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  block: tuple[int, int] | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """kernels.moe.fused_moe over FP8 expert stacks (w13 [E, 2I, H], w2 [E, H, I] with row or block scales).

    CUDA, decode (<= 64 pairs): GEMVs that read FP8 (triton_fp8_moe.py); more pairs (prefill, mixed and
    large decode steps): the grouped GEMMs that widen FP8 in registers (triton_fp8_moe_gemm.py). Both are
    weight-only and free of host syncs. The CPU reference (and CUDA scale blocks the grouped kernels cannot
    tile) dequantizes the stacks to x's dtype for kernels.moe.fused_moe."""
    if use_triton(x) and x.dtype in (torch.bfloat16, torch.float16):
        if topk_ids.numel() <= MOE_GEMV_PAIRS:
            from lamina.kernels.triton_fp8_moe import fp8_moe_gemv

            return fp8_moe_gemv(x, w13, s13, w2, s2, block, topk_weights, topk_ids)
        from lamina.kernels.triton_fp8_moe_gemm import fp8_moe_grouped, grouped_block_ok

        if grouped_block_ok(block):
            return fp8_moe_grouped(x, w13, s13, w2, s2, block, topk_weights, topk_ids)
    from lamina.kernels.moe import fused_moe

    return fused_moe(x, dequantize(w13, s13, block, x.dtype), dequantize(w2, s2, block, x.dtype), topk_weights,
                     topk_ids)
