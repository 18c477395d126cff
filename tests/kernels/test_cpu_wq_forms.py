"""The CPU forms of weight-quantized linears (wq_matmul.CpuInt4Pack for 4 bits, CpuInt8Split for 8) against
an fp64 matmul of the dequantized weight, on fresh random weights (full int8 range, nonzero offsets, the
group sizes torch's int4 kernel takes, ragged N). Both forms round only the activations and the scales to
bf16, so against the same roundings in fp64 they agree to accumulation error; against the exact weight to
bf16's 2^-9."""
from __future__ import annotations

import pytest
import torch

from lamina.kernels.wq_matmul import CpuInt4Pack, CpuInt8Split, cpu_int4_ok, dequantize, pack_int4

pytestmark = pytest.mark.skipif(not hasattr(torch, "_weight_int4pack_mm_for_cpu"), reason="no CPU int4 matmul")


def _weight(n: int, k: int, group: int, bits: int, offsets: bool, gen: torch.Generator):
    q = torch.randint(0, 16 if bits == 4 else 256, (n, k), generator=gen)
    qweight = pack_int4(q) if bits == 4 else (q - 128).to(torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.005).half()
    off = (torch.randn(n, k // group, generator=gen) * 0.05).half() if offsets else torch.zeros_like(scales)
    return qweight, scales, off


def _bf16_scaled_reference(qweight, scales, offsets, bits, x):
    """What the CPU forms compute, in fp64: bf16 x, bf16 scales; the zero point s * 8 + o rounded to bf16."""
    q = (qweight.to(torch.int64) if bits == 8 else dequantize(qweight, torch.ones_like(scales),
                                                              torch.zeros_like(scales), 4)).double()
    s = scales.float().bfloat16().double()
    if bits == 4:  # W = (q - 8) * s + zero, zero = bf16(o + 8s)
        zero = (offsets.float() + 8 * scales.float()).bfloat16().double()
        w = (q.view(q.shape[0], s.shape[1], -1) - 8) * s[..., None] + zero[..., None]
    else:  # hi part exact in s; lo part's zero bf16(8s + o)
        zero = (offsets.float() + 8 * scales.float()).bfloat16().double()
        qi = q.view(q.shape[0], s.shape[1], -1)
        hi, lo = torch.div(qi, 16, rounding_mode="floor"), torch.remainder(qi, 16)
        w = hi * 16 * s[..., None] + (lo - 8) * s[..., None] + zero[..., None]
    return x.bfloat16().double() @ w.reshape(q.shape[0], -1).t()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,group", [(1, 96, 256, 32), (5, 48, 512, 64), (3, 64, 256, 128), (1, 48, 512, 256)])
@pytest.mark.parametrize("offsets", [False, True], ids=["symmetric", "offsets"])
def test_cpu_form_matches_dequantized_weight(bits, m, n, k, group, offsets):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + group + bits)
    qweight, scales, off = _weight(n, k, group, bits, offsets, gen)
    assert cpu_int4_ok(qweight, scales, bits)
    form = (CpuInt4Pack if bits == 4 else CpuInt8Split).build(qweight, scales, off)
    x = torch.randn(m, k, generator=gen)
    got = form.matmul(x)
    assert got.dtype == x.dtype and got.shape == (m, n)
    exact = x.double() @ dequantize(qweight, scales, off, bits, torch.float64).t()
    assert ((got.double() - exact).norm() / exact.norm()).item() < 4e-3  # bf16 activations and scales
    same_rounding = _bf16_scaled_reference(qweight, scales, off, bits, x)
    err = ((got.double() - same_rounding).norm() / same_rounding.norm()).item()
    assert err < 2e-3 if bits == 4 else err < 4e-3  # bf16 outputs of the kernel (two for 8 bits)


def test_cpu_int4_ok_refuses_what_the_kernel_cannot_take():
    gen = torch.Generator().manual_seed(0)
    q8, s8, _ = _weight(16, 256, 16, 8, False, gen)  # group 16: not a group torch's kernel tiles
    assert not cpu_int4_ok(q8, s8, 8)
    q6, s6, _ = _weight(16, 256, 32, 8, False, gen)
    assert not cpu_int4_ok(q6, s6, 6)
    assert cpu_int4_ok(q6, s6, 8)
    q4, s4, _ = _weight(40, 256, 32, 4, False, gen)  # N = 40: the packing tiles N by 16
    assert not cpu_int4_ok(q4, s4, 4)
