"""Soft-capped attention (Gemma 2) and GeGLU's tanh-GELU-and-mul: the torch references against a direct
per-sequence computation written as HF transformers does it, and the Triton kernels against the references
(through Triton's interpreter on CPU-only machines), with NaN-poisoned outputs and unused cache slots."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import INTERPRET, TOL, rel_err
from test_triton_kernels import make_step, scaled

from lamina.kernels.activation import gelu_tanh_and_mul_ref
from lamina.kernels.attention import paged_attention_ref


def direct_attention(q, kc, vc, meta, scale, window, softcap):
    """HF's eager attention (repeat K/V, scale, cap * tanh(s / cap), causal + window mask, softmax) for every
    sequence of the step, reading its keys through its block table."""
    page, hkv = kc.shape[1], kc.shape[2]
    out = torch.zeros(q.shape[0], q.shape[1], vc.shape[-1], dtype=torch.float64)
    qs, lens = meta.query_start_cpu, meta.seq_lens_cpu
    for b in range(meta.num_seqs):
        sl, ql = lens[b], qs[b + 1] - qs[b]
        pos = torch.arange(sl)
        slots = meta.block_tables[b].cpu().long()[pos // page] * page + pos % page
        k = kc.reshape(-1, hkv, kc.shape[-1]).cpu()[slots].double()
        v = vc.reshape(-1, hkv, vc.shape[-1]).cpu()[slots].double()
        g = q.shape[1] // hkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        qq = q[qs[b]:qs[b + 1]].cpu().double()
        s = torch.einsum("lhd,shd->hls", qq, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(sl - ql, sl)[:, None]
        allowed = pos[None] <= q_pos
        if window:
            allowed &= pos[None] > q_pos - window
        s = s.masked_fill(~allowed[None], float("-inf"))
        out[qs[b]:qs[b + 1]] = torch.einsum("hls,shd->lhd", s.softmax(-1), v)
    return out


CASES = {  # (query_len, seq_len) per sequence, Hq, Hkv, D, sliding window, softcap
    "mixed_capped": ([(1, 300), (40, 90), (1, 7)], 8, 2, 64, None, 5.0),
    "mixed_capped_window": ([(1, 200), (60, 130)], 4, 2, 32, 24, 2.0),
    "decode_capped": ([(1, 500), (1, 33)], 8, 4, 64, None, 1.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_softcap_reference_matches_direct(case):
    specs, hq, hkv, d, window, cap = CASES[case]
    q, k, v, kc, vc, meta = make_step(specs, hq, hkv, d, torch.float32, page=16, seed=3)
    kc, vc = kc.nan_to_num(0), vc.nan_to_num(0)
    from lamina.kernels.attention import store_kv_ref

    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    scale = d ** -0.5 * 4  # large scores, so the cap bends them
    ours = paged_attention_ref(q, kc, vc, meta, scale, window, softcap=cap)
    assert (ours.double().cpu() - direct_attention(q, kc, vc, meta, scale, window, cap)).abs().max() < 1e-5
    uncapped = paged_attention_ref(q, kc, vc, meta, scale, window)
    assert (ours - uncapped).abs().max() > 1e-2  # the cap changes the result on these scores


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", list(CASES))
def test_softcap_triton_matches_reference(case, dtype):
    from lamina.kernels.triton_attention import paged_attention_triton, store_kv_triton

    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("interpreter bf16 dots are wrong")

    specs, hq, hkv, d, window, cap = CASES[case]
    specs = [(ql if ql == 1 else scaled(ql), max(scaled(sl), scaled(ql) if ql > 1 else 1)) for ql, sl in specs]
    q, k, v, kc, vc, meta = make_step(specs, hq, hkv, d, dtype, seed=5)
    store_kv_triton(k, v, kc, vc, meta.slot_mapping)
    scale = d ** -0.5 * 4
    oracle = paged_attention_ref(q.float(), kc.float().nan_to_num(0), vc.float().nan_to_num(0), meta, scale,
                                 window, softcap=cap)
    splits_options = (None, 1, 4) if 1 in [ql for ql, _ in specs] else (None,)
    for splits in splits_options:
        out = paged_attention_triton(q, kc, vc, meta, scale, window, softcap=cap,
                                     out=torch.full_like(q, float("nan")), num_splits=splits,
                                     poison_workspace=True)
        assert rel_err(out, oracle) < TOL[dtype], (splits, rel_err(out, oracle))


def test_gelu_tanh_reference_is_hf_gelu_pytorch_tanh():
    from transformers.activations import ACT2FN

    x = 3 * torch.randn(5, 2 * 37, dtype=torch.float64)
    gate, up = x.chunk(2, -1)
    assert torch.allclose(gelu_tanh_and_mul_ref(x), ACT2FN["gelu_pytorch_tanh"](gate) * up, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(17, 2 * 1000), (1, 2 * 11)])
def test_gelu_tanh_and_mul_triton(shape, dtype):
    from kernel_helpers import DEV

    from lamina.kernels.triton_activation import gelu_tanh_and_mul_triton

    x = (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1]))).to(dtype).to(DEV)
    out = gelu_tanh_and_mul_triton(x, out=torch.full((*shape[:-1], shape[-1] // 2), float("nan"),
                                                     dtype=dtype, device=DEV))
    ref = gelu_tanh_and_mul_ref(x.double())
    assert rel_err(out, ref) < TOL[dtype]
    gate = x.double()[..., : shape[-1] // 2]
    assert rel_err(out, F.gelu(gate, approximate="tanh") * x.double()[..., shape[-1] // 2:]) < TOL[dtype]
