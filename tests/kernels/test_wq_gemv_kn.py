"""The repacked ("kn") 4-bit decode GEMV (kernels/triton_wq_gemv_kn.py) against the dequantized weight's
fp64 matmul on fresh random weights: M in {1, 3, 16}, groups 32 / 128, symmetric (offset = -8 scale, GPTQ
without zeros) and asymmetric offsets, odd N (a ragged last tile), split-K through the semaphore (run twice:
the semaphores must be back at zero), a ragged K tail, bf16 / fp16 / fp32 activations."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, TOL, rel_err

from lamina.kernels.wq_matmul import dequantize, pack_int4


def _weight(n: int, k: int, group: int, sym: bool, gen: torch.Generator):
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.005).half()
    offsets = (-8 * scales.float()).half() if sym else (torch.randn(n, k // group, generator=gen) * 0.05).half()
    return pack_int4(q), scales, offsets


@pytest.mark.parametrize("m,n,k,group,sym", [(1, 37, 512, 128, True), (3, 41, 256, 32, False),
                                              (16, 25, 384, 128, False), (1, 64, 1024, 32, True),
                                              (3, 33, 768, 128, True)])
def test_kn_gemv_matches_reference(m, n, k, group, sym):
    from lamina.kernels.triton_wq_gemv_kn import KnConfig, KnWeight, kn_dequantize, kn_gemv

    gen = torch.Generator().manual_seed(m * 7 + n + k + group)
    qweight, scales, offsets = _weight(n, k, group, sym, gen)
    w_ref = dequantize(qweight, scales, offsets, 4)
    kn = KnWeight.build(qweight.to(DEV), scales.to(DEV), offsets.to(DEV))
    assert torch.equal(kn_dequantize(kn).cpu(), w_ref)  # the repack loses nothing
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ w_ref.double().t()
    # the default; 16 columns x 4 words (several splits, a ragged K tail at K = 384 / 768); one split
    for cfg in (KnConfig(), KnConfig(block_n=16, block_kw=4, split_k=5), KnConfig(block_n=32, block_kw=32,
                                                                                   split_k=1)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for _ in range(2):
                out = kn_gemv(x.to(DEV, dtype), kn, cfg, sms=4)
                assert out.dtype == dtype and out.shape == (m, n)
                assert rel_err(out, ref) < TOL[dtype] * 3, (dtype, cfg)
            assert not kn.locks.any()


def test_kn_plan_every_split_has_work():
    from lamina.kernels.triton_wq_gemv_kn import KnConfig, plan

    for n, kw, sms in ((4096, 512, 132), (6144, 512, 132), (24576, 512, 132), (4096, 1536, 132), (40, 48, 8)):
        block_kw, per, splits = plan(n, kw, sms, KnConfig())
        steps = -(-kw // block_kw)
        assert (splits - 1) * per < steps <= splits * per


def test_kn_refuses_bad_shapes():
    from lamina.kernels.triton_wq_gemv_kn import KnWeight

    q = torch.zeros(8, 6, dtype=torch.uint8)  # K = 12: not whole words
    with pytest.raises(ValueError, match="K % 8"):
        KnWeight.build(q, torch.ones(8, 1).half(), torch.zeros(8, 1).half())


@pytest.mark.parametrize("m,n,k,group,sym", [(3, 41, 256, 32, False), (16, 25, 384, 128, True),
                                              (37, 33, 256, 128, False)])
def test_kn_matmul_matches_reference(m, n, k, group, sym):
    """The tensor-core path on the same layout (fp16 / fp32: the interpreter's bf16 dots read raw bits)."""
    from lamina.kernels.triton_wq_gemm_kn import kn_matmul
    from lamina.kernels.triton_wq_gemv_kn import KnWeight

    gen = torch.Generator().manual_seed(m + n + k + group)
    qweight, scales, offsets = _weight(n, k, group, sym, gen)
    kn = KnWeight.build(qweight.to(DEV), scales.to(DEV), offsets.to(DEV))
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ dequantize(qweight, scales, offsets, 4).double().t()
    for dtype in (torch.float16, torch.float32):
        for block_kw in (16, 32):  # 32 on K = 384: a ragged last step
            out = kn_matmul(x.to(DEV, dtype), kn, block_n=32, block_kw=block_kw)
            assert out.dtype == dtype and out.shape == (m, n)
            assert rel_err(out, ref) < TOL[dtype] * 3, (dtype, block_kw)


@pytest.mark.parametrize("m,n,k,group,sym", [(1, 37, 256, 128, True), (3, 41, 256, 32, False),
                                              (16, 25, 256, 32, True), (3, 33, 512, 128, False)])
def test_wq_dispatch_candidates_match_reference(m, n, k, group, sym):
    """Every path the dispatcher may pick (its untimed pick and all it times) for the M bucket, on the kn copy
    and the old layout, with 4 SMs so that split-K runs (fp16 / fp32 activations: the interpreter's bf16 dots
    read raw bits), and the dispatcher's untimed call."""
    import triton

    from lamina.kernels.triton_wq_gemv_kn import KnWeight
    from lamina.kernels.wq_dispatch import WqDispatcher, candidates_for, run_path

    gen = torch.Generator().manual_seed(11 * m + n + k + group)
    qweight, scales, offsets = (t.to(DEV) for t in _weight(n, k, group, sym, gen))
    kn = KnWeight.build(qweight, scales, offsets)
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ dequantize(qweight.cpu(), scales.cpu(), offsets.cpu(), 4).double().t()
    cands = candidates_for(triton.next_power_of_2(m), n, k, group, 4, 4, True)
    assert any(p.kind == "kn" for p in cands) and (m == 1 or any(p.kind == "old" for p in cands))
    dtype = torch.float16 if m != 3 or group == 32 else torch.float32
    for path in cands:
        for _ in range(2):  # twice: the split-K semaphores must be back at zero
            out = run_path(path, x.to(DEV, dtype), qweight, scales, offsets, 4, kn, sms=4)
            assert out.dtype == dtype and out.shape == (m, n)
            assert rel_err(out, ref) < TOL[dtype] * 3, path.label()
        assert not kn.locks.any()
    disp = WqDispatcher(tune=False)
    for w in (kn, None):
        out = disp(x.to(DEV, torch.float16), qweight, scales, offsets, 4, w)
        assert rel_err(out, ref) < TOL[torch.float16] * 3


def test_wq_dispatch_table_and_tuner(monkeypatch):
    """The untimed picks follow the table (M = 1: kn where the copy exists; M = 2..16: the 16-row dot tile);
    the tuner (timing faked: no GPU here) keeps the fastest candidate that matches the reference and says
    why it rejected a wrong one."""
    from lamina.kernels import gemv as gemv_mod
    from lamina.kernels import wq_dispatch as wd
    from lamina.kernels.triton_wq_gemv_kn import KnConfig, KnWeight

    assert wd.heuristic_path(1, 6144, 4096, 128, 4, 132, True).cfg == KnConfig(block_n=128, block_kw=32)
    assert wd.heuristic_path(1, 4096, 12288, 128, 4, 132, True).cfg == KnConfig(block_n=256, block_kw=16, waves=3)
    assert wd.heuristic_path(1, 4096, 4096, 128, 4, 132, False).cfg.kernel.startswith("gemv")
    for m in (2, 4, 16):
        p = wd.heuristic_path(m, 4096, 4096, 128, 4, 132, True)
        assert p.kind == "old" and p.cfg.kernel == "dot_join" and p.cfg.block_m == 16
    assert wd.heuristic_path(64, 4096, 4096, 128, 4, 132, True).cfg.block_m == 64

    gen = torch.Generator().manual_seed(5)
    n, k, group = 24, 256, 128
    qweight, scales, offsets = (t.to(DEV) for t in _weight(n, k, group, False, gen))
    kn = KnWeight.build(qweight, scales, offsets)
    bad = wd.WqPath("kn", KnConfig(block_n=16, block_kw=4, split_k=1))
    good = wd.WqPath("kn", KnConfig(block_n=32, block_kw=8, rows=4))
    monkeypatch.setattr(wd, "candidates_for", lambda *a: [good, bad])
    real_run = wd.run_path
    # the "bad" path is the fastest and wrong: it must be rejected on its error, not picked for its speed
    monkeypatch.setattr(wd, "run_path", lambda p, *a, **kw: real_run(p, *a, **kw) * (2.0 if p == bad else 1.0))
    monkeypatch.setattr(gemv_mod, "_graph_time_us", lambda fn, flush: 1.0)
    monkeypatch.setattr(gemv_mod, "_l2_bytes", lambda device: 1024)
    disp = wd.WqDispatcher(tune=True)
    x = torch.randn(4, k, generator=gen).to(DEV, torch.float16)
    key = (4, n, k, group, 4, x.dtype, str(x.device), True)
    assert disp._choose(key, x, qweight, scales, offsets, 4, kn, 4) == good
    assert disp.paths[key] == good and "error" in disp.rejected[key][0]
