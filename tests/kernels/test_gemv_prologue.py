"""The decode GEMV's prologues (RMSNorm, residual add + RMSNorm, SiLU/GELU-and-mul on x) against the separate
torch reference ops followed by a float64 linear, on plain and split-K configs of both inner products.
Outputs and the residual sum start NaN-poisoned. Interpreter: dot configs in fp16/fp32 only (bf16 dots are
computed on raw bits there) and bf16 casts truncate, so the bf16 sum is compared with a tolerance."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEV, INTERPRET, TOL, rel_err

from lamina.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from lamina.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref


def _configs():
    from lamina.kernels.triton_gemv import GemvConfig

    # (block_n, block_k, split, warps, stages, dot); with K = 200 the last 64-wide tile of a split is ragged.
    return [GemvConfig(8, 64, 1, 2, 2, False), GemvConfig(8, 64, 3, 2, 2, False),
            GemvConfig(16, 64, 1, 4, 2, True), GemvConfig(16, 64, 2, 4, 2, True)]


def _dtypes(cfg):
    return [torch.float16, torch.float32] if cfg.dot and INTERPRET else [torch.bfloat16, torch.float16]


def _run(x, w, cfg, prologue, m, n, bias=None):
    from lamina.kernels.triton_gemv import gemv, new_workspace

    ws = new_workspace(m, n, cfg, DEV) if cfg.split_k > 1 else None
    outs = []
    for _ in range(2):  # the second launch relies on the first having reset the split-K counters
        out = torch.full((m, n), float("nan"), dtype=x.dtype, device=DEV)
        outs.append(gemv(x, w, bias, cfg, ws, out=out, prologue=prologue))
    if ws is not None:
        assert int(ws[1].abs().sum()) == 0, "split-K counters not reset"
    return outs


@pytest.mark.parametrize("m,k", [(1, 192), (3, 192), (5, 192), (1, 200), (5, 200)])
@pytest.mark.parametrize("kind", ["norm", "add_norm"])
def test_norm_prologue_matches_norm_then_linear(m, k, kind):
    from lamina.kernels.triton_gemv import Prologue

    n, eps, off = 40, 1e-6, 0.5 if m == 3 else 0.0
    gen = torch.Generator().manual_seed(m * 10 + len(kind))
    for cfg in _configs():
        for dtype in _dtypes(cfg):
            x = (3 * torch.randn(m, k, generator=gen)).to(dtype)
            r = torch.randn(m, k, generator=gen).to(dtype)
            nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
            if kind == "add_norm":
                normed, summed = fused_add_rms_norm_ref(x, r, nw, eps, off)
                sums = torch.full((m, k), float("nan"), dtype=dtype, device=DEV)
                pro = Prologue(kind, nw.to(DEV), eps, off, r.to(DEV), sums)
            else:
                normed, summed, pro = rms_norm_ref(x, nw, eps, off), None, Prologue(kind, nw.to(DEV), eps, off)
            b = torch.randn(n, generator=gen).to(dtype) if m == 5 else None  # Qwen2's qkv bias: after 1/rms
            ref = F.linear(normed.double(), w.double(), b.double() if b is not None else None)
            for out in _run(x.to(DEV), w.to(DEV), cfg, pro, m, n, b.to(DEV) if b is not None else None):
                assert rel_err(out, ref) < TOL[dtype], (cfg, dtype, rel_err(out, ref))
            if summed is not None:
                if dtype == torch.bfloat16 and INTERPRET:
                    assert rel_err(sums, summed) < TOL[dtype]
                else:
                    assert torch.equal(sums.cpu(), summed), (cfg, dtype)


@pytest.mark.parametrize("m,k", [(1, 192), (4, 200)])
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_act_prologue_matches_act_then_linear(m, k, kind):
    from lamina.kernels.triton_gemv import Prologue

    n = 40
    act = silu_and_mul_ref if kind == "silu" else gelu_tanh_and_mul_ref
    gen = torch.Generator().manual_seed(m + len(kind))
    for cfg in _configs():
        for dtype in _dtypes(cfg):
            x = (2 * torch.randn(m, 2 * k, generator=gen)).to(dtype)
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
            ref = F.linear(act(x.double()), w.double())
            for out in _run(x.to(DEV), w.to(DEV), cfg, Prologue(kind), m, n):
                assert rel_err(out, ref) < TOL[dtype], (cfg, dtype, rel_err(out, ref))


def test_prologue_is_not_a_no_op():
    """The oracle above would also pass a kernel that ignored the norm weight if the weight were all ones:
    here a weight of 2 must double the output and the eps must matter on a zero row."""
    from lamina.kernels.triton_gemv import GemvConfig, Prologue, gemv

    cfg = GemvConfig(8, 64, 1, 2, 2, False)
    x = torch.randn(2, 128).to(DEV)
    x[1] = 0.0
    w = torch.randn(16, 128).to(DEV)
    one = gemv(x, w, None, cfg, prologue=Prologue("norm", torch.ones(128, device=DEV), 1e-6))
    two = gemv(x, w, None, cfg, prologue=Prologue("norm", torch.full((128,), 2.0, device=DEV), 1e-6))
    assert torch.allclose(two, 2 * one, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(one).all() and bool((one[1] == 0).all())
    assert rel_err(one[:1], F.linear(rms_norm_ref(x[:1], torch.ones(128, device=DEV), 1e-6), w)) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the timed config choice needs CUDA")
@pytest.mark.parametrize("kind", ["add_norm", "silu"])
def test_dispatcher_times_each_prologue_and_matches(kind):
    """A prologue is tuned as a shape of its own (its winner may differ: the tile math costs registers), the
    pick passes the reference, and the call inside a CUDA graph replays it."""
    from lamina.kernels.gemv import GemvDispatcher
    from lamina.kernels.triton_gemv import Prologue

    d = GemvDispatcher(enabled=True)
    w = (torch.randn(4096, 4096, device="cuda") / 64).bfloat16()
    nw = (1 + 0.1 * torch.randn(4096, device="cuda")).bfloat16()
    for m in (1, 4):
        width = 8192 if kind == "silu" else 4096
        x = torch.randn(m, width, device="cuda").bfloat16()
        r = torch.randn(m, 4096, device="cuda").bfloat16()
        sums = torch.empty_like(r)
        pro = Prologue(kind) if kind == "silu" else Prologue(kind, nw, 1e-6, 0.0, r, sums)
        ref_in = silu_and_mul_ref(x.float()) if kind == "silu" else rms_norm_ref((x + r).float(), nw.float(), 1e-6)
        y = d(x, w, None, pro)
        assert rel_err(y, F.linear(ref_in, w.float())) < TOL[torch.bfloat16]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = d(x, w, None, pro)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, y)
    assert sum(1 for key in d.configs if key[-1] == kind) == 2 and all(d.timings.values())
