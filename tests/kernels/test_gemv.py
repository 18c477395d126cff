"""The decode GEMV (every candidate config, split-K included) against F.linear on fp32 copies, and the
dispatcher's fallback rules. Outputs start NaN-poisoned. Under the interpreter bf16 dots are wrong (raw bits),
so dot configs run in fp16/fp32 there and bf16 only through the fma configs; the GPU runs everything."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEV, INTERPRET, TOL, rel_err

from lamina.kernels.gemv import GemvDispatcher, linear_decode

SHAPES = [(48, 512, True), (40, 200, False)]  # (N, K, bias): K a multiple of every tile, and a ragged K


def _configs(m, n, k):
    from lamina.kernels.triton_gemv import GemvConfig, candidate_configs

    cands = candidate_configs(m, n, k, num_sms=2)
    # Explicit splits too: three splits of a ragged K leave the last one empty on K=200 with 64-wide tiles.
    extra = [GemvConfig(16, 64, 3, 4, 2, True), GemvConfig(16, 64, 2, 2, 2, True)]
    if m <= 4:
        extra.append(GemvConfig(8, 64, 3, 2, 2, False))
    return cands + extra


def _dtypes(cfg):
    if cfg.dot and INTERPRET:
        return [torch.float16, torch.float32]
    return [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"n{n}k{k}" for n, k, _ in SHAPES])
def test_gemv_every_config(m, shape):
    from lamina.kernels.triton_gemv import gemv, new_workspace

    n, k, has_bias = shape
    gen = torch.Generator().manual_seed(m * 1000 + n)
    for cfg in _configs(m, n, k):
        for dtype in _dtypes(cfg):
            x = torch.randn(m, k, generator=gen).to(dtype)
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
            b = torch.randn(n, generator=gen).to(dtype) if has_bias else None
            ref = F.linear(x.double(), w.double(), b.double() if b is not None else None)
            ws = new_workspace(m, n, cfg, DEV) if cfg.split_k > 1 else None
            for _ in range(2):  # the second launch relies on the first having reset the split-K counters
                out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
                gemv(x.to(DEV), w.to(DEV), b.to(DEV) if b is not None else None, cfg, ws, out=out)
                assert rel_err(out, ref) < TOL[dtype], (cfg, dtype, rel_err(out, ref))
            if ws is not None:
                assert int(ws[1].abs().sum()) == 0, "split-K counters not reset"


def test_gemv_strided_rows_and_heuristic():
    from lamina.kernels.triton_gemv import gemv

    x_full = torch.randn(3, 2 * 256).to(torch.bfloat16)
    x = x_full[:, :256]  # row stride 512
    w = torch.randn(64, 256).to(torch.bfloat16)
    out = gemv(x.to(DEV), w.to(DEV))  # heuristic config (fma for <= 2 rows, dot above: 3 rows -> dot)
    if INTERPRET:
        out = gemv(x[:2].to(DEV), w.to(DEV))
        x = x[:2]
    assert rel_err(out, F.linear(x.double(), w.double())) < TOL[torch.bfloat16]


def test_candidates_cover_small_n_with_split():
    from lamina.kernels.triton_gemv import auto_split, candidate_configs

    assert auto_split(4096, 12288, 16, 256, 132) > 1  # down projection: 256 N blocks < 4 x 132 SMs
    assert auto_split(151936, 4096, 16, 256, 132) == 1  # lm_head has programs enough
    for m in (1, 2, 4, 8, 16):
        cands = candidate_configs(m, 1024, 4096, 132)
        assert any(c.split_k > 1 for c in cands) and len(cands) <= 16
        assert all(c.dot for c in cands) == (m > 4)


def test_linear_decode_falls_back_without_cuda_or_switch():
    x, w, b = torch.randn(2, 64), torch.randn(32, 64), torch.randn(32)
    off = GemvDispatcher(enabled=False)
    assert torch.equal(linear_decode(x, w, b, off), F.linear(x, w, b))
    assert torch.equal(linear_decode(x, w, b), F.linear(x, w, b))
    on = GemvDispatcher(enabled=True)
    assert not on.accepts(x, w, b)  # CPU tensors always take F.linear
    assert torch.equal(linear_decode(x, w, b, on), F.linear(x, w, b))
    assert GemvDispatcher().enabled in (False, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the timed config choice needs CUDA")
def test_dispatcher_tunes_once_and_matches_linear():
    d = GemvDispatcher(enabled=True)
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    for m in (1, 3, 16):
        x = torch.randn(m, 4096, device="cuda").bfloat16()
        assert d.accepts(x, w, None)
        assert rel_err(d(x, w), F.linear(x.float(), w.float())) < TOL[torch.bfloat16]
    assert len(d.configs) == 3 and all(d.timings.values())
    x = torch.randn(17, 4096, device="cuda").bfloat16()
    assert not d.accepts(x, w, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_split_k_gemv_cuda_graph_replays():
    from lamina.kernels.triton_gemv import GemvConfig, gemv, new_workspace

    cfg = GemvConfig(16, 256, 4, 4, 4, True)
    w = (torch.randn(1024, 4096, device="cuda") / 64).bfloat16()
    x = torch.randn(5, 4096, device="cuda").bfloat16()
    ws = new_workspace(5, 1024, cfg, x.device)
    out = gemv(x, w, None, cfg, ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, w, None, cfg, ws, out=out)
    for _ in range(3):
        x.copy_(torch.randn(5, 4096, device="cuda").bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out, F.linear(x.float(), w.float())) < TOL[torch.bfloat16]
    assert int(ws[1].abs().sum()) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch needs an sm_90 GPU")
@pytest.mark.parametrize("split", [1, 2])
def test_pdl_gemv_chain_in_a_graph(split):
    """PDL configs (L2 prefetch before griddepcontrol.wait) in a chain where each GEMV reads the previous one's
    output, eager and replayed from a CUDA graph: every link must see its input fully written."""
    from lamina.kernels.triton_gemv import GemvConfig, gemv, new_workspace

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs sm_90+")
    cfg = GemvConfig(32, 256, split, 4, 4, True, pdl=True, prefetch_k=1024)
    ws = [(torch.randn(2048, 2048, device="cuda") / 45).bfloat16() for _ in range(4)]
    x = torch.randn(3, 2048, device="cuda").bfloat16()
    work = [new_workspace(3, 2048, cfg, x.device) if split > 1 else None for _ in ws]
    outs = [torch.empty(3, 2048, device="cuda", dtype=torch.bfloat16) for _ in ws]

    def chain():
        h = x
        for w, o, wk in zip(ws, outs, work):
            h = gemv(h, w, None, cfg, wk, out=o)
        return h

    def oracle():
        h = x.float()
        for w in ws:
            h = (h @ w.float().T).bfloat16().float()
        return h

    assert rel_err(chain(), oracle()) < 3 * TOL[torch.bfloat16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        x.copy_(torch.randn(3, 2048, device="cuda").bfloat16())
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        assert rel_err(outs[-1], oracle()) < 3 * TOL[torch.bfloat16]


def test_linear_takes_the_dispatcher_when_switched_on(monkeypatch):
    """LAMINA_TRITON_GEMV=1 at construction gives every Linear the process's dispatcher; a dense, unpartitioned
    weight then goes through it (CUDA check bypassed on a CPU: the interpreter runs the kernel), others not."""
    from lamina.kernels import gemv as gemv_mod
    from lamina.models.layers.linear import Linear

    assert Linear(64, 32).gemv is None or gemv_mod.os.environ.get("LAMINA_TRITON_GEMV") == "1"
    monkeypatch.setenv("LAMINA_TRITON_GEMV", "1")
    lin = Linear(64, {"a": 16, "b": 24}, bias=True)
    assert lin.gemv is gemv_mod.env_dispatcher() and lin.gemv is Linear(8, 8).gemv  # one per process
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 64) / 8)
        lin.bias.copy_(torch.randn(40))
    x = torch.randn(3, 64).to(torch.float16)
    lin = lin.to(torch.float16)
    want = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    assert rel_err(lin(x), want) < TOL[torch.float16]  # CPU: F.linear
    x, lin, want = x.to(DEV), lin.to(DEV), want.to(DEV)  # the kernel runs natively on a GPU, interpreted on a CPU
    monkeypatch.setattr(gemv_mod, "use_triton", lambda t: True)
    calls = []
    orig = gemv_mod.GemvDispatcher.__call__
    monkeypatch.setattr(gemv_mod.GemvDispatcher, "__call__", lambda self, *a: calls.append(1) or orig(self, *a))
    lin.gemv.tune = False  # no CUDA timing on a CPU: the heuristic config
    assert rel_err(lin(x), want) < TOL[torch.float16] and calls == [1]
