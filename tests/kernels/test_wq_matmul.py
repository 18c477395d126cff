"""The Triton weight-quantized matmul against the torch reference (dequantize, then F.linear in fp64) on
fresh random 4- and 8-bit weights: every tile path (one scale per tile, a scale gather for groups smaller
than the tile), split-K decode and unsplit prefill, ragged M/N/K. Under the interpreter bf16 dots read raw
bits, so it runs fp16/fp32 there; the GPU adds bf16."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, INTERPRET, TOL, rel_err

from lamina.kernels.wq_matmul import dequantize

DTYPES = [torch.float16, torch.float32] if INTERPRET else [torch.float16, torch.bfloat16, torch.float32]


def _weight(n: int, k: int, group: int, bits: int, gen: torch.Generator):
    hi = 16 if bits == 4 else 256
    q = torch.randint(0, hi, (n, k), generator=gen)
    if bits == 4:
        from lamina.kernels.wq_matmul import pack_int4

        qweight = pack_int4(q)
    else:
        qweight = (q - 128).to(torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.005).half()
    offsets = (torch.randn(n, k // group, generator=gen) * 0.05).half()
    return qweight, scales, offsets


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,group", [(1, 72, 256, 32), (3, 64, 384, 128), (16, 40, 160, 16),
                                          (37, 136, 256, 64), (70, 24, 128, 32)])
def test_wq_matmul_matches_reference(bits, m, n, k, group):
    from lamina.kernels.triton_wq_matmul import WqConfig, heuristic_config, wq_matmul

    gen = torch.Generator().manual_seed(m * 7 + n + k + bits)
    qweight, scales, offsets = _weight(n, k, group, bits, gen)
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ dequantize(qweight, scales, offsets, bits).double().t()
    configs = [heuristic_config(m, n, k, group, sms=8), WqConfig(16, 32, 32, 3), WqConfig(32, 64, 64, 1)]
    for dtype in DTYPES:
        for cfg in configs:
            out = wq_matmul(x.to(DEV, dtype), qweight.to(DEV), scales.to(DEV), offsets.to(DEV), bits, cfg)
            assert out.dtype == dtype and out.shape == (m, n)
            assert rel_err(out, ref) < TOL[dtype] * 3, (dtype, cfg)
