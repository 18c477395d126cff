"""Triton kernels against their torch references, on fresh random inputs.

Runs on a CUDA machine; on a CPU it runs only under TRITON_INTERPRET=1 (slow, fp16/fp32 attention only:
Triton 3.6's interpreter computes bf16 dots on raw bits). Triton is imported inside the tests, so the file
collects without it. Errors are ||out - oracle|| / ||oracle|| against the reference on fp32 copies.
"""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import CUDA, DEV, INTERPRET, TOL, rel_err

from lamina.kernels.activation import silu_and_mul_ref
from lamina.kernels.attention import AttentionMetadata, paged_attention_ref, store_kv_ref
from lamina.kernels.norm import rms_norm_ref
from lamina.kernels.rope import apply_rope_ref, rope_cos_sin_cache, rope_inv_freq

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def make_step(specs, hq, hkv, d, dtype, page=16, seed=0):
    """specs: [(query_len, seq_len)]. Old context random in the cache, every unused slot NaN."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-sl // page) for _, sl in specs]
    nblocks = sum(need) + 3
    perm = torch.randperm(nblocks, generator=gen)
    tables = torch.randint(0, nblocks, (len(specs), max(need)), generator=gen, dtype=torch.int32)
    kc = torch.full((nblocks, page, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    qs, slots, used = [0], [], 0
    for i, (ql, sl) in enumerate(specs):
        tables[i, :need[i]] = perm[used:used + need[i]].int()
        used += need[i]
        pos = torch.arange(sl)
        slot = tables[i, pos // page].long() * page + pos % page
        kc.view(-1, hkv, d)[slot[:sl - ql]] = torch.randn(sl - ql, hkv, d, generator=gen).to(dtype)
        vc.view(-1, hkv, d)[slot[:sl - ql]] = torch.randn(sl - ql, hkv, d, generator=gen).to(dtype)
        slots.append(slot[sl - ql:])
        qs.append(qs[-1] + ql)
    lens = [sl for _, sl in specs]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEV), query_start=torch.tensor(qs, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV), block_tables=tables.to(DEV),
        query_start_cpu=qs, seq_lens_cpu=lens, max_query_len=max(q for q, _ in specs), max_seq_len=max(lens))
    t = qs[-1]
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype).to(DEV) for h in (hq, hkv, hkv))
    return q, k, v, kc.to(DEV), vc.to(DEV), meta


def scaled(n: int) -> int:
    return max(2, n // 8) if INTERPRET else n


ATTN_CASES = {
    "decode_g4_d128": ([(1, 700), (1, 33), (1, 1200), (1, 1)], 8, 2, 128, None),
    "decode_g1_d64": ([(1, 300), (1, 65)], 4, 4, 64, None),
    "decode_g8_long": ([(1, 4096)], 16, 2, 128, None),
    "decode_window": ([(1, 900), (1, 40)], 8, 2, 64, 100),
    "prefill_fresh_g4": ([(300, 300), (77, 77)], 8, 2, 64, None),
    "prefill_chunked_g8": ([(200, 1000), (129, 400)], 16, 2, 128, None),
    "prefill_window": ([(250, 600)], 4, 4, 64, 64),
    "mixed_g4": ([(1, 500), (90, 300), (1, 17), (160, 160), (1, 999)], 8, 2, 128, None),
    "mixed_g7_window": ([(1, 400), (70, 250)], 14, 2, 128, 48),
}


# bf16 everywhere; fp16 and fp32 on a few cases (each dtype/shape combination is one more compile).
ATTN_PARAMS = [(c, torch.bfloat16) for c in ATTN_CASES] + [
    (c, dt) for c in ("decode_g4_d128", "prefill_chunked_g8", "mixed_g7_window") for dt in DTYPES[1:]]


@pytest.mark.parametrize("case,dtype", ATTN_PARAMS, ids=[f"{c}-{str(d)[6:]}" for c, d in ATTN_PARAMS])
def test_store_kv_and_paged_attention(case, dtype):
    from lamina.kernels.triton_attention import paged_attention_triton, store_kv_triton

    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("interpreter bf16 dots are wrong")
    specs, hq, hkv, d, window = ATTN_CASES[case]
    specs = [(ql if ql == 1 else scaled(ql), max(scaled(sl), scaled(ql) if ql > 1 else 1)) for ql, sl in specs]
    q, k, v, kc, vc, meta = make_step(specs, hq, hkv, d, dtype, seed=len(case))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv_triton(k, v, kc, vc, meta.slot_mapping)
    store_kv_ref(k, v, kc_ref, vc_ref, meta.slot_mapping)
    for a, b in ((kc, kc_ref), (vc, vc_ref)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))
    scale = d ** -0.5
    oracle = paged_attention_ref(q.float(), kc.float().nan_to_num(0), vc.float().nan_to_num(0), meta, scale, window)
    # NaN-poisoned output: every row must be written; both decode paths (direct and split-K) are checked.
    for splits in (None, 1, 8) if meta.max_query_len == 1 or 1 in [q for q, _ in specs] else (None,):
        out = paged_attention_triton(q, kc, vc, meta, scale, window, out=torch.full_like(q, float("nan")),
                                     num_splits=splits, poison_workspace=True)
        assert rel_err(out, oracle) < TOL[dtype], (splits, rel_err(out, oracle))


def test_store_kv_skips_padding_slots():
    from lamina.kernels.triton_attention import store_kv_triton

    kc = torch.full((4, 16, 2, 64), float("nan"), dtype=torch.float16, device=DEV)
    vc = kc.clone()
    k, v = (torch.randn(5, 2, 64, device=DEV).half() for _ in range(2))
    slots = torch.tensor([3, -1, 40, -1, 63], device=DEV)
    kr, vr = kc.clone(), vc.clone()
    store_kv_triton(k, v, kc, vc, slots)
    store_kv_ref(k, v, kr, vr, slots)
    assert torch.equal(kc.isnan(), kr.isnan()) and torch.equal(kc.nan_to_num(0), kr.nan_to_num(0))
    assert torch.equal(vc.nan_to_num(0), vr.nan_to_num(0))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_cuda_graph_replays_other_context_lengths():
    from lamina.kernels.triton_attention import paged_attention_triton

    hq, hkv, d, page, b, width = 16, 2, 128, 16, 4, 256  # width * page = 4096 tokens per sequence at most
    gen = torch.Generator().manual_seed(7)
    kc = torch.randn(b * width + 1, page, hkv, d, generator=gen).bfloat16().to(DEV)
    vc = torch.randn(b * width + 1, page, hkv, d, generator=gen).bfloat16().to(DEV)
    q = torch.randn(b, hq, d, generator=gen).bfloat16().to(DEV)
    qs = list(range(b + 1))
    meta = AttentionMetadata(slot_mapping=torch.zeros(b, dtype=torch.int64, device=DEV),
                             query_start=torch.tensor(qs, dtype=torch.int32, device=DEV),
                             seq_lens=torch.ones(b, dtype=torch.int32, device=DEV),
                             block_tables=torch.zeros(b, width, dtype=torch.int32, device=DEV),
                             query_start_cpu=qs, seq_lens_cpu=[1] * b, max_query_len=1, max_seq_len=1)
    paged_attention_triton(q, kc, vc, meta, d ** -0.5)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, kc, vc, meta, d ** -0.5)
    for lens in ([5, 4096, 17, 300], [4000, 1, 2048, 999], [1, 1, 1, 1]):
        tables = torch.randperm(b * width, generator=gen)[: b * width].view(b, width).int()
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        meta.block_tables.copy_(tables)
        q.copy_(torch.randn(b, hq, d, generator=gen).bfloat16())
        graph.replay()
        host = AttentionMetadata(meta.slot_mapping, meta.query_start, meta.seq_lens, meta.block_tables, qs, lens,
                                 1, max(lens))
        ref = paged_attention_ref(q.float(), kc.float(), vc.float(), host, d ** -0.5)
        assert rel_err(out, ref) < TOL[torch.bfloat16], lens


@pytest.mark.skipif(not CUDA, reason="dispatch picks Triton only for CUDA tensors")
def test_dispatch_uses_triton():
    from lamina.kernels import attention
    from lamina.kernels.dispatch import triton_available

    assert triton_available()
    q, k, v, kc, vc, meta = make_step([(1, 50), (20, 60)], 4, 2, 64, torch.float16)
    attention.store_kv(k, v, kc, vc, meta.slot_mapping)
    out = attention.paged_attention(q, kc, vc, meta, 0.125)
    ref = paged_attention_ref(q.float(), kc.float().nan_to_num(0), vc.float().nan_to_num(0), meta, 0.125)
    assert rel_err(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(33, 96), (4, 7, 128), (3, 5000)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norms(shape, dtype, offset):
    from lamina.kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton

    gen = torch.Generator().manual_seed(sum(shape))
    x, r = (torch.randn(*shape, generator=gen).to(dtype).to(DEV) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(DEV)
    assert rel_err(rms_norm_triton(x, w, 1e-6, offset), rms_norm_ref(x.float(), w.float(), 1e-6, offset)) < TOL[dtype]
    if x.dim() == 3:  # a strided view, as q of a fused qkv buffer would be
        xs = torch.randn(shape[0], shape[1] * 2, shape[2], generator=gen).to(dtype).to(DEV)[:, ::2]
        assert rel_err(rms_norm_triton(xs, w, 1e-6, offset), rms_norm_ref(xs.float(), w.float(), 1e-6, offset)) \
            < TOL[dtype]
    x0, r0 = x.clone(), r.clone()
    normed, summed = fused_add_rms_norm_triton(x, r, w, 1e-6, offset)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    ref_sum = x.float() + r.float()
    assert rel_err(summed, ref_sum) < TOL[dtype]
    assert rel_err(normed, rms_norm_ref(summed.float(), w.float(), 1e-6, offset)) < TOL[dtype]
    # In place, the way a decoder loop may call it.
    n2, s2 = fused_add_rms_norm_triton(x, r, w, 1e-6, offset, out=x, sum_out=r)
    assert n2.data_ptr() == x.data_ptr() and s2.data_ptr() == r.data_ptr()
    assert torch.equal(s2, summed) and torch.equal(n2, normed)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("hq,hk,d,rot", [(8, 2, 128, 128), (6, 1, 64, 64), (4, 4, 80, 40), (3, 1, 128, 64)])
def test_rope_in_place(hq, hk, d, rot, dtype):
    from lamina.kernels.triton_rope import apply_rope_triton

    gen = torch.Generator().manual_seed(d + rot)
    t = 37
    inv, factor = rope_inv_freq(rot, 10000.0, None)
    cs = rope_cos_sin_cache(inv, 4096, factor).to(DEV)
    pos = torch.randint(0, 4096, (t,), generator=gen).to(DEV)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype).to(DEV)
    q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    v0 = qkv[:, (hq + hk) * d:].clone()
    rq, rk = apply_rope_ref(q.float(), k.float(), pos, cs)
    q2, k2 = apply_rope_triton(q, k, pos, cs)
    assert q2.data_ptr() == q.data_ptr() and torch.equal(qkv[:, (hq + hk) * d:], v0)
    assert rel_err(q2, rq) < TOL[dtype] and rel_err(k2, rk) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(17, 2 * 1000), (2, 3, 2 * 4096), (1, 2 * 11)])
def test_silu_and_mul(shape, dtype):
    from lamina.kernels.triton_activation import silu_and_mul_triton

    x = (2 * torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1]))).to(dtype).to(DEV)
    out = silu_and_mul_triton(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert rel_err(out, silu_and_mul_ref(x.double())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_gated_on_strided_gate(dtype):
    from lamina.kernels.norm_gated import rms_norm_gated_ref
    from lamina.kernels.triton_norm import rms_norm_gated_triton

    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("interpreter bf16 casts truncate")
    gen = torch.Generator().manual_seed(3)
    t, h, d = 5, 4, 128
    x = torch.randn(t, h, d, generator=gen).to(dtype).to(DEV)
    proj = torch.randn(t, h * d + 40, generator=gen).to(dtype).to(DEV)  # the gate is a view into a projection
    gate = proj[:, 8:8 + h * d].view(t, h, d)
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype).to(DEV)
    out = rms_norm_gated_triton(x, gate, w, 1e-6)
    assert rel_err(out, rms_norm_gated_ref(x, gate, w, 1e-6)) < TOL[dtype]
