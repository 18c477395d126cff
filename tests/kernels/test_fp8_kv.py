"""FP8 (e4m3) KV cache in the Triton kernels: the KV store and the fused norm/RoPE/store quantize (saturating
at +-448) into NaN-poisoned FP8 caches like the torch reference does, and both attention kernels read FP8
caches and match the reference on the same (dequantized) cache contents (so attention keeps the fp16
tolerance)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, INTERPRET, TOL, rel_err
from test_attention_prep import make_inputs
from test_triton_kernels import ATTN_CASES, make_step, scaled

from lamina.kernels.attention import paged_attention_ref, store_kv_ref
from lamina.kernels.attention_prep import qk_norm_rope_store_ref as prep_ref

FP8 = torch.float8_e4m3fn


def assert_fp8_close(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> None:
    """Written rows equal to the reference's (both round to nearest even and saturate); the others still
    poisoned. Under the interpreter only, its float -> fp8 cast is not round-to-nearest-even (~2.5% of random
    values differ: one e4m3 step off, or half the value when rounding up should reach a power of two, as
    1.94 -> 1.0 instead of 2.0), so there those are let through; the GPU's cast must match exactly."""
    o, r = out.cpu().flatten(0, 1).float()[rows], ref.cpu().flatten(0, 1).float()[rows]
    assert torch.isfinite(o).all(), "NaN in a written slot (an unsaturated cast?)"
    ok = o == r
    if INTERPRET:
        pow2 = (r != 0) & (torch.frexp(r).mantissa.abs() == 0.5)
        ok |= (pow2 & (o * 2 == r)) | ((o - r).abs() <= r.abs() * 0.125 + 2**-9)  # or one e4m3 step off
        assert (o != r).float().mean() < 0.05
    assert ok.all(), f"{int((~ok).sum())} stored values differ from the reference"
    flat = out.cpu().flatten(0, 1).float()
    rest = torch.ones(flat.shape[0], dtype=torch.bool)
    rest[rows] = False
    assert flat[rest].isnan().all(), "a slot outside slot_mapping was written"


def test_store_kv_quantizes_and_saturates():
    from lamina.kernels.triton_attention import store_kv_triton

    gen = torch.Generator().manual_seed(0)
    t, h, d, page, nblocks = 7, 2, 64, 16, 3
    k = torch.randn(t, h, d, generator=gen) * 300  # some beyond 448: must saturate, not become NaN
    v = torch.randn(t, h, d, generator=gen)
    slots = torch.randperm(nblocks * page, generator=gen)[:t]
    slots[2] = -1
    caches = [torch.full((nblocks, page, h, d), float("nan")).to(FP8) for _ in range(4)]
    for dtype in (torch.float16, torch.float32):
        kc, vc = (c.clone().to(DEV) for c in caches[:2])
        kr, vr = (c.clone() for c in caches[2:])
        store_kv_triton(k.to(dtype).to(DEV), v.to(dtype).to(DEV), kc, vc, slots.to(DEV))
        store_kv_ref(k.to(dtype), v.to(dtype), kr, vr, slots)
        written = slots[slots >= 0]
        assert kr.flatten(0, 1)[written].float().abs().max() == 448
        assert_fp8_close(kc, kr, written)
        assert_fp8_close(vc, vr, written)


@pytest.mark.parametrize("case", ["qwen3_decode", "llama_no_norm", "partial_rotary_offset"])
def test_qk_norm_rope_store_into_fp8(case):
    from lamina.kernels.triton_attention_prep import qk_norm_rope_store_triton

    dtype = torch.float16
    q, k, v, pos, table, kc, vc, slots, (qw, kw), offset = make_inputs(case, dtype, seed=len(case))
    kc, vc = kc.to(FP8), vc.to(FP8)
    rkc, rvc = kc.clone(), vc.clone()
    oq = prep_ref(q, k, v, pos, table, rkc, rvc, slots, qw, kw, 1e-6, offset)
    dkc, dvc = kc.to(DEV), vc.to(DEV)
    dw = [w.to(DEV) if w is not None else None for w in (qw, kw)]
    out = qk_norm_rope_store_triton(q.to(DEV), k.to(DEV), v.to(DEV), pos.to(DEV), table.to(DEV), dkc, dvc,
                                    slots.to(DEV), *dw, 1e-6, offset)
    assert rel_err(out, oq) < TOL[dtype]
    written = slots[slots >= 0]
    assert_fp8_close(dkc, rkc, written)
    assert_fp8_close(dvc, rvc, written)


CASES = ["decode_g4_d128", "decode_window", "prefill_chunked_g8", "mixed_g4"]


@pytest.mark.parametrize("case", CASES)
def test_paged_attention_reads_fp8_caches(case):
    from lamina.kernels.triton_attention import paged_attention_triton

    dtype = torch.float16  # bf16 too on the GPU; the interpreter's bf16 dots are wrong
    specs, hq, hkv, d, window = ATTN_CASES[case]
    specs = [(ql if ql == 1 else scaled(ql), max(scaled(sl), scaled(ql) if ql > 1 else 1)) for ql, sl in specs]
    q, k, v, kc, vc, meta = make_step(specs, hq, hkv, d, dtype, seed=len(case))
    kc, vc = kc.to(FP8), vc.to(FP8)
    store_kv_ref(k.cpu(), v.cpu(), kc_cpu := kc.cpu(), vc_cpu := vc.cpu(), meta.slot_mapping.cpu())
    kc, vc = kc_cpu.to(DEV), vc_cpu.to(DEV)
    oracle = paged_attention_ref(q.float(), kc.float().nan_to_num(0), vc.float().nan_to_num(0), meta, d ** -0.5,
                                 window)
    dtypes = [dtype] if INTERPRET else [dtype, torch.bfloat16]
    for qd in dtypes:
        for splits in (None, 1, 8) if 1 in [ql for ql, _ in specs] else (None,):
            out = paged_attention_triton(q.to(qd), kc, vc, meta, d ** -0.5, window,
                                         out=torch.full_like(q.to(qd), float("nan")), num_splits=splits,
                                         poison_workspace=True)
            assert rel_err(out, oracle) < TOL[qd], (qd, splits)
    # The torch reference reads the FP8 cache as it is, too (the CPU path): the same numbers as on its
    # dequantized copy.
    clean = [c.float().nan_to_num(0).to(FP8) for c in (kc_cpu, vc_cpu)]
    ref = paged_attention_ref(q.float().cpu(), *clean, _cpu(meta), d ** -0.5, window)
    if DEV.type == "cpu":
        assert torch.equal(ref, oracle)
    else:  # the oracle ran on the GPU: same math, other rounding of the fp32 sums
        torch.testing.assert_close(ref, oracle.cpu(), rtol=1e-5, atol=1e-5)


def _cpu(meta):
    import dataclasses

    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping.cpu(), query_start=meta.query_start.cpu(),
                               seq_lens=meta.seq_lens.cpu(), block_tables=meta.block_tables.cpu(), ref_plan=None)
