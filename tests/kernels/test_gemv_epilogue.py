"""The decode GEMV's epilogues (SiLU/GELU-and-mul of the gate|up halves; residual add + RMSNorm of the whole
output row, finished by the last program) against the unfused torch reference ops on a float64 linear, on
fresh random inputs, plain and split-K configs of both inner products. Outputs start NaN-poisoned; each config
launches twice (the second relies on the first having reset the counters). Interpreter: dot configs in
fp16/fp32 only (bf16 dots are computed on raw bits there)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEV, INTERPRET, TOL, rel_err

from lamina.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from lamina.kernels.norm import rms_norm_ref


def _configs(split: bool):
    from lamina.kernels.triton_gemv import GemvConfig

    # (block_n, block_k, split, warps, stages, dot); K = 200 leaves a ragged last 64-wide tile.
    cfgs = [GemvConfig(8, 64, 1, 2, 2, False), GemvConfig(16, 64, 1, 4, 2, True)]
    return cfgs + ([GemvConfig(8, 64, 3, 2, 2, False), GemvConfig(16, 64, 2, 4, 2, True)] if split else [])


def _dtypes(cfg):
    return [torch.float16, torch.float32] if cfg.dot and INTERPRET else [torch.bfloat16, torch.float16]


def _tol(dtype) -> float:
    # the interpreter's bf16 casts truncate: the act epilogue rounds three times (gate, up, output), each
    # biased the same way
    return 3 * TOL[dtype] if dtype == torch.bfloat16 and INTERPRET else TOL[dtype]


@pytest.mark.parametrize("m,k", [(1, 192), (3, 200), (5, 192)])
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_act_epilogue_matches_linear_then_act(m, k, kind):
    from lamina.kernels.triton_gemv import Epilogue, gemv

    n = 40  # output columns; the weight has 2n rows (gate then up), the last N block is ragged
    act = silu_and_mul_ref if kind == "silu" else gelu_tanh_and_mul_ref
    gen = torch.Generator().manual_seed(7 * m + k + len(kind))
    for cfg in _configs(split=False):
        for dtype in _dtypes(cfg):
            x = torch.randn(m, k, generator=gen).to(dtype)
            w = (2 * torch.randn(2 * n, k, generator=gen) / k ** 0.5).to(dtype)
            b = torch.randn(2 * n, generator=gen).to(dtype) if m == 5 else None
            ref = act(F.linear(x.double(), w.double(), b.double() if b is not None else None))
            for _ in range(2):
                out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
                gemv(x.to(DEV), w.to(DEV), b.to(DEV) if b is not None else None, cfg, out=out,
                     epilogue=Epilogue(kind))
                assert rel_err(out, ref) < _tol(dtype), (cfg, dtype, rel_err(out, ref))


@pytest.mark.parametrize("m,k,n", [(1, 192, 40), (3, 200, 72), (5, 192, 24)])
def test_add_norm_epilogue_matches_linear_then_add_norm(m, k, n):
    from lamina.kernels.triton_gemv import Epilogue, gemv, new_workspace

    eps, off = 1e-6, 0.5 if m == 3 else 0.0
    gen = torch.Generator().manual_seed(11 * m + n)
    for cfg in _configs(split=True):
        for dtype in _dtypes(cfg):
            x = torch.randn(m, k, generator=gen).to(dtype)
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
            r = torch.randn(m, n, generator=gen).to(dtype)
            nw = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
            y = F.linear(x.double(), w.double())
            summed = (y + r.double())
            ref_h = rms_norm_ref(summed, nw.double(), eps, off)
            ws = new_workspace(m, n, cfg, DEV, "add_norm")
            for _ in range(2):
                out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
                h = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
                gemv(x.to(DEV), w.to(DEV), None, cfg, ws, out=out,
                     epilogue=Epilogue("add_norm", nw.to(DEV), eps, off, r.to(DEV), h))
                assert rel_err(out, summed) < _tol(dtype), (cfg, dtype, rel_err(out, summed))
                assert rel_err(h, ref_h) < _tol(dtype), (cfg, dtype, rel_err(h, ref_h))
                assert int(ws[1].abs().sum()) == 0, "counters not reset"


def test_add_norm_epilogue_is_not_a_no_op():
    """A norm weight of 2 doubles h, and a zero row (y + residual = 0) gives a finite zero h through eps."""
    from lamina.kernels.triton_gemv import Epilogue, GemvConfig, gemv

    cfg = GemvConfig(8, 64, 1, 2, 2, False)
    x = torch.randn(2, 128).to(DEV)
    w = torch.randn(16, 128).to(DEV)
    r = -F.linear(x, w)
    r[0] = torch.randn(16)
    hs = []
    for scale in (1.0, 2.0):
        h = torch.empty(2, 16, device=DEV)
        gemv(x, w, None, cfg, epilogue=Epilogue("add_norm", torch.full((16,), scale, device=DEV), 1e-6, 0.0,
                                                r.clone(), h))
        hs.append(h)
    assert torch.allclose(hs[1], 2 * hs[0], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(hs[0]).all() and float(hs[0][1].abs().max()) < 1e-2
