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
