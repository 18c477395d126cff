"""The FP8 GEMV (decode) and block-scaled GEMM (prefill) against the dequantized-weight torch matmul in fp64,
on fresh random inputs with ragged shapes, row and block scales, bias and no bias. The GEMM's oracle uses the
same FP8 activations and scales (its inputs), so the only difference is accumulation order. Under the
interpreter bf16 dots are unreliable, so the GEMV runs fp16/fp32 there and bf16 on the GPU."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, INTERPRET, rel_err

from lamina.kernels.fp8 import (
    FP8,
    dequantize,
    expand_block_scale,
    quantize_blocks,
    quantize_rows,
    quantize_tokens,
)

GEMV_DTYPES = [torch.float16, torch.float32] if INTERPRET else [torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _weight(n, k, block, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different magnitude
    q, s = quantize_blocks(w, block) if block else quantize_rows(w)
    return q.to(DEV), s.to(DEV), g


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("shape", [(48, 256, None, True), (40, 200, None, False), (72, 96, (32, 32), True),
                                   (64, 160, (16, 32), False)],
                         ids=["rows", "rows-ragged", "block32", "block16x32-ragged"])
def test_fp8_gemv_matches_dequantized_matmul(m, shape):
    from lamina.kernels.triton_fp8_gemv import GemvConfig, fp8_gemv

    n, k, block, has_bias = shape
    q, s, g = _weight(n, k, block, seed=m * 100 + n)
    for dtype in GEMV_DTYPES:
        x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
        bias = torch.randn(n, generator=g).to(dtype).to(DEV) if has_bias else None
        ref = x.double() @ dequantize(q, s, block).double().T + (bias.double() if has_bias else 0)
        configs = [None] + [GemvConfig("dot", bn) for bn in (16, 32)] + [GemvConfig("dot16", 16)] + [
            GemvConfig(v, bn, bk, 4) for bn, bk in ((8, 64), (16, 128)) for v in ("fma", "fmasum")
            if not block or bn <= block[0]]
        for config in configs:  # the heuristic's pick, then every variant the GPU sweep times
            y = fp8_gemv(x, q, s, block, bias, config=config)
            assert y.dtype == dtype and y.shape == (m, n)
            assert rel_err(y, ref) < TOL[dtype], (dtype, config)


def test_fp8_gemv_fma_refuses_tiles_across_scale_blocks():
    """fma tiles read one scale row per program, so they must not straddle two bn-row scale blocks."""
    from lamina.kernels.triton_fp8_gemv import GemvConfig, fp8_gemv

    q, s, _ = _weight(64, 64, (16, 32), seed=2)
    with pytest.raises(ValueError, match="must divide"):
        fp8_gemv(torch.randn(1, 64, device=DEV), q, s, (16, 32), config=GemvConfig("fma", 32, 64))


def test_fp8_block_gemm_refuses_narrow_k_blocks():
    """FP8 tensor-core dots need K tiles >= 32 (the H200 refused 16): 16-wide blocks are a clear error here,
    and fp8_linear sends them to the dequantized matmul."""
    from lamina.kernels.triton_fp8_gemm import fp8_block_gemm

    q, s, g = _weight(64, 64, (16, 16), seed=1)
    xq, xs = quantize_tokens(torch.randn(4, 64, generator=g).to(DEV), group=16)
    with pytest.raises(ValueError, match="narrower than 32"):
        fp8_block_gemm(xq, xs, q, s, (16, 16), torch.bfloat16)


def test_fp8_gemv_refuses_too_many_rows():
    from lamina.kernels.triton_fp8_gemv import fp8_gemv

    q, s, _ = _weight(16, 32, None, 0)
    with pytest.raises(ValueError, match="at most 16"):
        fp8_gemv(torch.randn(17, 32, device=DEV), q, s, None)


@pytest.mark.parametrize("shape", [(40, 48, 256, (16, 128)), (33, 72, 160, (32, 32)), (20, 64, 64, (32, 32))],
                         ids=["block16x128", "ragged-32", "square32"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_fp8_block_gemm_matches_dequantized_matmul(shape, out_dtype):
    from lamina.kernels.triton_fp8_gemm import fp8_block_gemm

    m, n, k, block = shape
    q, s, g = _weight(n, k, block, seed=m + n)
    x = torch.randn(m, k, generator=g).to(DEV)
    xq, xs = quantize_tokens(x, group=block[1])
    assert xq.dtype == FP8 and xs.shape == (m, -(-k // block[1]))
    bias = torch.randn(n, generator=g).to(out_dtype).to(DEV)
    a = xq.double() * expand_block_scale(xs, (m, k), (1, block[1])).double()
    ref = a @ dequantize(q, s, block).double().T
    tiles = (16, 32, 2, 4, 1) if INTERPRET else None
    y = fp8_block_gemm(xq, xs, q, s, block, out_dtype, tiles=tiles)
    assert y.dtype == out_dtype and rel_err(y, ref) < TOL[out_dtype]
    y = fp8_block_gemm(xq, xs, q, s, block, out_dtype, bias, tiles=tiles)
    assert rel_err(y, ref + bias.double()) < TOL[out_dtype]
    # Activation quantization itself stays within e4m3's rounding (3 mantissa bits: <= 2^-4 relative).
    assert rel_err(a.float(), x) < 0.05


@pytest.mark.parametrize("block", [None, (16, 32)], ids=["rows", "block16x32"])
@pytest.mark.parametrize("tokens, top_k", [(1, 2), (5, 3)])
def test_fp8_moe_gemv_matches_the_dequantized_reference(block, tokens, top_k):
    """FP8 expert stacks through the decode GEMVs vs fused_moe_ref on the dequantized stacks (fp64)."""
    from lamina.kernels.moe import fused_moe_ref
    from lamina.kernels.triton_fp8_moe import fp8_moe_gemv

    e, h, i = 4, 96, 48  # ragged against the 64-wide tiles below
    g = torch.Generator().manual_seed(tokens * 10 + top_k)
    stacks = []
    for n, k in ((2 * i, h), (h, i)):
        w = torch.randn(e, n, k, generator=g) * 0.1
        qs = [quantize_blocks(w[j], block) if block else quantize_rows(w[j]) for j in range(e)]
        stacks.append((torch.stack([q for q, _ in qs]).to(DEV), torch.stack([s for _, s in qs]).to(DEV)))
    (w13, s13), (w2, s2) = stacks
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)]).to(DEV)
    weights = torch.rand(tokens, top_k, generator=g).to(DEV)
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    x = torch.randn(tokens, h, generator=g).to(dtype).to(DEV)
    ref = fused_moe_ref(x.double(), dequantize(w13, s13, block).double(), dequantize(w2, s2, block).double(),
                        weights.double(), ids)
    for bk in (None, 64):
        out = fp8_moe_gemv(x, w13, s13, w2, s2, block, weights.to(dtype), ids, block_k=bk)
        assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype], bk


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the script is the benchmark itself (scripts/gpu_run.sh fp8)")
def test_gpu_bench_script_checks_pass_under_the_interpreter():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "fp8_gpu_bench.py"
    done = subprocess.run([sys.executable, str(script), "--interpret", "--sweep"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "all checks passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize("m", [5, 32])
@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_rows_path(m, static):
    """The row-scaled prefill path (torch._scaled_mm, which torch also runs on the CPU): activations quantized
    per token (or with a static scale), M padded to 16, bias added, vs the matmul of the same FP8 operands."""
    from lamina.kernels.fp8 import _scaled_mm_rows

    q, s, g = _weight(48, 64, None, seed=m)
    x = torch.randn(m, 64, generator=g).to(torch.bfloat16).to(DEV)
    bias = torch.randn(48, generator=g).to(torch.bfloat16).to(DEV)
    static_scale = torch.tensor([0.02], device=DEV) if static else None
    xq, xs = quantize_tokens(x, static_scale=static_scale)
    ref = (xq.double() * xs.double()) @ dequantize(q, s, None).double().T + bias.double()
    y = _scaled_mm_rows(x, q, s, bias, static_scale)
    assert y.shape == (m, 48) and y.dtype == torch.bfloat16 and rel_err(y, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("group, static", [(None, False), (None, True), (32, False), (128, False)],
                         ids=["token", "static", "group32", "group128"])
@pytest.mark.parametrize("m, k", [(5, 200), (16, 4096 + 64)])
def test_triton_activation_quant_matches_the_torch_reference(group, static, m, k):
    """The fused quantization kernel vs kernels.fp8.quantize_tokens: same scales, same FP8 codes (the
    interpreter's fp8 cast is patched to round like the GPU), zero padding rows, either scale layout."""
    from lamina.kernels.triton_fp8_quant import quantize_tokens_triton

    g = torch.Generator().manual_seed(m + k + (group or 0))
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 50).to(torch.bfloat16)
    x[1, : k // 2] = 0  # a zero group (and for per-token, a row whose amax sits in its second half)
    if m > 3:
        x[3] = 0  # an all-zero token: the tiny scale, not NaN
    x = x.to(DEV)
    static_scale = torch.tensor([0.03], device=DEV) if static else None
    qr, sr = quantize_tokens(x, group=group, static_scale=static_scale)
    for major in (False, True):
        q, s = quantize_tokens_triton(x, group, static_scale, pad_m=16, scales_m_major=major)
        assert q.shape == (-(-m // 16) * 16, k) and s.shape[0] == q.shape[0] and q.dtype == FP8
        assert s.stride(0) == (1 if major else s.shape[1])
        assert torch.equal(s[:m].cpu(), sr.cpu())
        assert torch.equal(q[:m].view(torch.uint8).cpu(), qr.view(torch.uint8).cpu())
        assert not q[m:].float().abs().any()


@pytest.mark.parametrize("block", [(32, 32), (16, 128)], ids=["block32", "block16x128"])
def test_block_scaled_mm_triton_path(block):
    """kernels.fp8.block_scaled_mm (fused quantization + Triton GEMM) vs the matmul of the reference's FP8
    activations and the dequantized weight, with bias."""
    from lamina.kernels.fp8 import block_scaled_mm

    m, n, k = 37, 64, 256
    q, s, g = _weight(n, k, block, seed=7)
    x = torch.randn(m, k, generator=g).to(torch.float16).to(DEV)
    bias = torch.randn(n, generator=g).to(torch.float16).to(DEV)
    xq, xs = quantize_tokens(x, group=block[1])
    ref = (xq.double() * expand_block_scale(xs, (m, k), (1, block[1])).double()) @ dequantize(q, s, block).double().T
    y = block_scaled_mm(x, q, s, block, bias)
    assert y.shape == (m, n) and y.dtype == torch.float16 and rel_err(y, ref + bias.double()) < TOL[torch.float16]
