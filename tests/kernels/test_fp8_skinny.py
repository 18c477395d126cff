"""The skinny FP8 decode GEMM (triton_fp8_skinny.py: swap-AB tensor-core tiles, split-K) against the
dequantized-weight matmul in fp64 on fresh random inputs: M in {1, 2, 5, 16}, row and block scales, ragged
N and K, bias, both operand variants, unsplit and split K (the last-arriving program reduces)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, INTERPRET, rel_err

from lamina.kernels.fp8 import dequantize, quantize_blocks, quantize_rows

DTYPES = [torch.float16, torch.bfloat16] if INTERPRET else [torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _case(n, k, block, m, dtype, seed, big=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    q, s = quantize_blocks(w, block) if block else quantize_rows(w)
    x = torch.randn(m, k, generator=g)
    if big:  # rows far outside fp16's range and far below it: tc16's per-row power-of-two scaling
        x[0] *= 3e6
        x[-1] *= 1e-7
    x = x.to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return q.to(DEV), s.to(DEV), x.to(DEV), bias.to(DEV)


@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("shape", [(72, 200, None), (96, 256, (32, 32)), (40, 160, (16, 32))],
                         ids=["rows-ragged", "block32", "block16x32-ragged"])
def test_fp8_skinny_matches_dequantized_matmul(m, shape):
    from lamina.kernels.triton_fp8_skinny import SkinnyConfig, fp8_skinny

    n, k, block = shape
    bk = 32 if block else 64
    configs = [None, SkinnyConfig("tc", 64, bk, 1, 4, 2), SkinnyConfig("tc16", 64, bk, 2, 4, 2),
               SkinnyConfig("tc16", 32, 16, 4, 4, 2)]
    for i, dtype in enumerate(DTYPES):
        q, s, x, bias = _case(n, k, block, m, dtype, seed=m * 1000 + n + i, big=m > 1 and i == 1)
        ref = x.double() @ dequantize(q, s, block).double().T
        for j, config in enumerate(configs):
            b = bias if j % 2 else None
            want = ref + (b.double() if b is not None else 0)
            y = fp8_skinny(x, q, s, block, b, config=config)
            assert y.dtype == dtype and y.shape == (m, n)
            assert rel_err(y, want) < TOL[dtype], (dtype, config)


def test_fp8_skinny_split_k_is_replayable():
    """Split-K counters are left at zero by every launch: the same workspace gives the same answer again,
    and a split larger than K's steps is trimmed (no program without work)."""
    from lamina.kernels.triton_fp8_skinny import SkinnyConfig, fp8_skinny, workspace

    q, s, x, _ = _case(64, 96, (32, 32), 3, torch.float16, seed=5)
    ref = x.double() @ dequantize(q, s, (32, 32)).double().T
    cfg = SkinnyConfig("tc16", 64, 32, 3, 4, 2)
    first = fp8_skinny(x, q, s, (32, 32), config=cfg)
    again = fp8_skinny(x, q, s, (32, 32), config=cfg)
    assert torch.equal(first, again) and rel_err(first, ref) < TOL[torch.float16]
    assert not workspace(64, cfg, x.device)[1].any()
    assert rel_err(fp8_skinny(x, q, s, (32, 32), config=SkinnyConfig("tc", 64, 32, 8, 4, 2)), ref) < 2e-3


def test_fp8_skinny_refuses_k_steps_across_scale_blocks():
    from lamina.kernels.triton_fp8_skinny import SkinnyConfig, fp8_skinny

    q, s, x, _ = _case(64, 128, (32, 32), 2, torch.float16, seed=1)
    with pytest.raises(ValueError, match="must divide"):
        fp8_skinny(x, q, s, (32, 32), config=SkinnyConfig("tc16", 64, 64))


def test_skinny_switch_parsing():
    from lamina.kernels.fp8 import skinny_variant

    assert skinny_variant(4, "") is None and skinny_variant(4, "fma") is None
    assert skinny_variant(4, "tc16") == "tc16" and skinny_variant(1, "tc16") is None
    assert skinny_variant(1, "tc+m1") == "tc" and skinny_variant(16, "tc+m1") == "tc"
    assert skinny_variant(4, "off") is None and skinny_variant(4, "", device=torch.device("cpu")) is None


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the script is the benchmark itself (gpu_night.sh fp8skinny)")
def test_skinny_bench_script_checks_pass_under_the_interpreter():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "fp8_skinny_bench.py"
    done = subprocess.run([sys.executable, str(script), "--interpret"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "all checks passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
