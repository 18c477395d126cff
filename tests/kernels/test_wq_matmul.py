"""The Triton weight-quantized matmul against the torch reference (dequantize, then a matmul in fp64) on
fresh random 4- and 8-bit weights: every kernel variant (gemv with the exponent trick, with a register
prefetch, with the plain convert; dot on half-tiles; dot on the re-interleaved tile), both scale paths (one
group per K step, several groups per step), split-K, ragged M/N/K. Under the interpreter bf16 dots read raw
bits, so the dot kernels run fp16/fp32 there and the gemv (no dot) runs bf16 too; the GPU runs all three."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, INTERPRET, TOL, rel_err

from lamina.kernels.wq_matmul import dequantize, pack_int4

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _weight(n: int, k: int, group: int, bits: int, gen: torch.Generator):
    q = torch.randint(0, 16 if bits == 4 else 256, (n, k), generator=gen)
    qweight = pack_int4(q) if bits == 4 else (q - 128).to(torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.005).half()
    offsets = (torch.randn(n, k // group, generator=gen) * 0.05).half()
    return qweight, scales, offsets


def _configs(m: int, n: int, k: int, group: int, bits: int):
    from lamina.kernels.triton_wq_matmul import WqConfig, heuristic_config

    # block_k 64 with group 16/32 takes several groups per step; 128 with group 128 one; 256 on K = 384 a
    # ragged tail; split 3 a split-K that leaves one program idle on short K.
    return [heuristic_config(m, n, k, group, 8, bits), WqConfig("gemv", 1, 16, 64), WqConfig("gemv_pf", 1, 8, 64),
            WqConfig("gemv_cvt", 1, 32, 256, 3), WqConfig("dot", 16, 32, 64, 2), WqConfig("dot_join", 32, 16, 128)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,group", [(1, 37, 512, 128), (3, 41, 256, 16), (16, 25, 384, 128),
                                          (37, 33, 256, 64), (128, 19, 128, 32)])
def test_wq_matmul_matches_reference(bits, m, n, k, group):
    from lamina.kernels.triton_wq_matmul import wq_matmul

    gen = torch.Generator().manual_seed(m * 7 + n + k + bits)
    qweight, scales, offsets = _weight(n, k, group, bits, gen)
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ dequantize(qweight, scales, offsets, bits).double().t()
    args = (qweight.to(DEV), scales.to(DEV), offsets.to(DEV), bits)
    for cfg in _configs(m, n, k, group, bits):
        for dtype in DTYPES:
            if INTERPRET and dtype == torch.bfloat16 and not cfg.kernel.startswith("gemv"):
                continue
            out = wq_matmul(x.to(DEV, dtype), *args, cfg)
            assert out.dtype == dtype and out.shape == (m, n)
            assert rel_err(out, ref) < TOL[dtype] * 3, (dtype, cfg)


def test_wq_matmul_strided_x_and_exotic_group():
    """A non-contiguous x (a column slice) and a group no power-of-two K step tiles (K = 3 x 40: the
    reference path)."""
    from lamina.kernels.triton_wq_matmul import WqConfig, wq_matmul

    gen = torch.Generator().manual_seed(5)
    for k, group in ((256, 32), (120, 40)):
        qweight, scales, offsets = _weight(21, k, group, 4, gen)
        x = torch.randn(3, 2 * k, generator=gen)[:, ::2]
        ref = x.double() @ dequantize(qweight, scales, offsets, 4).double().t()
        out = wq_matmul(x.to(DEV, torch.float32), qweight.to(DEV), scales.to(DEV), offsets.to(DEV), 4,
                        WqConfig("gemv", 1, 16, 128))
        assert rel_err(out, ref) < TOL[torch.float32] * 3, (k, group)


def test_fit_block_k():
    from lamina.kernels.triton_wq_matmul import fit_block_k

    assert fit_block_k(64, 128, 4096, 16) == 64  # a step lies in one group
    assert fit_block_k(256, 32, 4096, 16) == 256  # or covers whole groups
    assert fit_block_k(256, 96, 192, 16) == 32  # never straddles two (96 is not a power of two)
    assert fit_block_k(512, 12288, 12288, 16) == 512  # per-channel scales on K = 3 x 4096
    assert fit_block_k(256, 48, 96, 32) == 0  # nothing >= 32 tiles groups of 48
