"""The packed decode kernel (triton_decode_attention.py) against the torch reference on fresh random inputs:
GQA ratios 1/2/4/7/8, head dims 64/128/256, KV heads per program 1..8, contexts from one token to past four
pages ending on and off page boundaries, forced splits 1..64 and the table's own choice, sliding windows,
soft-capping, FP8 caches, padding sequences, prefill rows left to the prefill kernel; plus the host-side split
policy. Caches and outputs are NaN-poisoned (kernel_helpers.rel_err fails on any non-finite output)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import CUDA, DEV, INTERPRET, TOL, rel_err
from test_triton_kernels import make_step

from lamina.kernels.attention import AttentionMetadata, paged_attention_ref, store_kv_ref

FP8 = torch.float8_e4m3fn
DT = torch.float16  # the interpreter's bf16 dots are wrong; bf16 runs on the GPU
DTYPES = [DT] if INTERPRET else [DT, torch.bfloat16]
PAGE = 16

# name: (seq lens, hq, hkv, d, page)
SHAPES = {
    "g2_d128_qwen06b": ([1, 15, 16, 17, 64, 65, 100], 4, 2, 128, 16),
    "g1_d64": ([33, 1, 80], 4, 4, 64, 16),
    "g4_d128": ([47, 96, 3], 8, 2, 128, 16),
    "g8_d64_long": ([260], 16, 2, 64, 16),
    "g7_d64": ([70, 9], 14, 2, 64, 16),
    "g2_d256": ([40, 17], 4, 2, 256, 16),
    "g2_hkv8_page32": ([31, 32, 33, 130], 16, 8, 64, 32),
    "g2_hkv3_d64": ([50, 5], 6, 3, 64, 16),  # KV heads not a power of two: a packed group runs off the end
}
# (heads per program, tokens per step, forced splits, block ids a step ahead; None: the table's)
CONFIGS = [(1, None, None, None), (1, None, 1, False), (1, None, 1, True), (2, 16, 4, False), (4, 16, None, True),
           (8, 16, 2, None), (1, 32, 8, False), (2, 32, 64, True)]


def _run(q, kc, vc, meta, window=None, softcap=None, heads=1, block_n=None, splits=None, variant="new",
         ahead=None):
    from lamina.kernels.triton_attention import paged_attention_triton

    tune = {"decode_heads": heads} if heads > 1 else {}
    if block_n:
        tune["decode_block_n"] = block_n
    if ahead is not None:
        tune["decode_ids_ahead"] = ahead
    return paged_attention_triton(q, kc, vc, meta, q.shape[-1] ** -0.5, window, softcap=softcap,
                                  out=torch.full_like(q, float("nan")), num_splits=splits, tune=tune,
                                  poison_workspace=True, decode_variant=variant)


def _decode_step(name, dtype, seed=0):
    lens, hq, hkv, d, page = SHAPES[name]
    q, k, v, kc, vc, meta = make_step([(1, n) for n in lens], hq, hkv, d, dtype, page=page, seed=seed)
    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    return q, kc, vc, meta


@pytest.mark.parametrize("name", list(SHAPES))
def test_packed_decode_matches_reference(name):
    q, kc, vc, meta = _decode_step(name, DT, seed=len(name))
    oracle = paged_attention_ref(q.float(), kc.float().nan_to_num(0), vc.float().nan_to_num(0), meta,
                                 q.shape[-1] ** -0.5)
    for heads, block_n, splits, ahead in CONFIGS:
        out = _run(q, kc, vc, meta, heads=heads, block_n=block_n, splits=splits, ahead=ahead)
        assert rel_err(out, oracle) < TOL[DT], (heads, block_n, splits, ahead)


@pytest.mark.parametrize("dtype", [torch.float32] + DTYPES[1:])
def test_packed_decode_other_dtypes(dtype):
    q, kc, vc, meta = _decode_step("g4_d128", dtype, seed=3)
    oracle = paged_attention_ref(q.float(), kc.float().nan_to_num(0), vc.float().nan_to_num(0), meta, 128 ** -0.5)
    for heads, splits, ahead in ((1, None, None), (2, 4, True), (1, 1, False)):
        assert rel_err(_run(q, kc, vc, meta, heads=heads, splits=splits, ahead=ahead), oracle) < TOL[dtype]


@pytest.mark.parametrize("window,softcap", [(20, None), (1, None), (None, 30.0), (40, 5.0)])
def test_packed_decode_window_and_softcap(window, softcap):
    q, kc, vc, meta = _decode_step("g2_d128_qwen06b", DT, seed=5)
    oracle = paged_attention_ref(q.float(), kc.float().nan_to_num(0), vc.float().nan_to_num(0), meta,
                                 128 ** -0.5, window, softcap)
    for heads, block_n, splits, ahead in ((1, None, None, None), (2, 16, 4, False), (1, 16, 8, True),
                                          (2, 32, 1, False), (1, 16, 1, True)):
        out = _run(q, kc, vc, meta, window, softcap, heads=heads, block_n=block_n, splits=splits, ahead=ahead)
        assert rel_err(out, oracle) < TOL[DT], (window, softcap, heads, splits)


def test_packed_decode_reads_fp8_caches():
    q, kc, vc, meta = _decode_step("g2_hkv8_page32", DT, seed=9)
    kc8, vc8 = kc.cpu().to(FP8).to(DEV), vc.cpu().to(FP8).to(DEV)
    oracle = paged_attention_ref(q.float(), kc8.float().nan_to_num(0), vc8.float().nan_to_num(0), meta, 64 ** -0.5)
    for qd in DTYPES:
        for heads, splits, ahead in ((1, None, None), (4, 2, False), (8, 1, True)):
            assert rel_err(_run(q.to(qd), kc8, vc8, meta, heads=heads, splits=splits, ahead=ahead), oracle) < TOL[qd]


@pytest.mark.parametrize("ks, vs, window, softcap", [(1.0, 1.0, None, None), (0.37, 2.5, 40, 30.0)])
def test_packed_decode_fp8_scales(ks, vs, window, softcap):
    """An FP8 cache holding K/ks and V/vs, read as the layer does (softmax scale * ks, output * vs), against
    the reference on the dequantized cache; the tables' FP8 configs and forced ones, V read as words and
    widened plainly (the words path is compiled-only: on the GPU both run)."""
    from lamina.kernels.triton_attention import paged_attention_triton

    q, kc, vc, meta = _decode_step("g4_d128", DT, seed=13)
    kc8, vc8 = ((c.cpu().float() / s).to(FP8) for c, s in ((kc, ks), (vc, vs)))
    oracle = paged_attention_ref(q.float().cpu(), kc8.float().nan_to_num(0) * ks, vc8.float().nan_to_num(0) * vs,
                                 _cpu(meta), 128 ** -0.5, window, softcap)
    kc8, vc8 = kc8.to(DEV), vc8.to(DEV)
    for qd in DTYPES:
        for tune, splits in (({}, None), ({"decode_heads": 2, "decode_block_n": 16}, 4),
                             ({"decode_block_n": 32, "decode_ids_ahead": True}, 1)):
            for words in (True, False):
                out = paged_attention_triton(q.to(qd), kc8, vc8, meta, 128 ** -0.5 * ks, window, softcap=softcap,
                                             out=torch.full_like(q.to(qd), float("nan")), num_splits=splits,
                                             tune={**tune, "decode_v_words": words}, poison_workspace=True)
                assert rel_err(out.float() * vs, oracle) < TOL[qd], (qd, tune, splits, words)


def _cpu(meta):
    import dataclasses

    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping.cpu(), query_start=meta.query_start.cpu(),
                               seq_lens=meta.seq_lens.cpu(), block_tables=meta.block_tables.cpu(), ref_plan=None)


def test_old_and_new_decode_agree():
    q, kc, vc, meta = _decode_step("g2_d128_qwen06b", DT, seed=11)
    for splits in (None, 1, 4):
        old = _run(q, kc, vc, meta, splits=splits, variant="old")
        new = _run(q, kc, vc, meta, splits=splits)
        assert rel_err(new, old.float()) < TOL[DT], splits


def test_variant_from_environment(monkeypatch):
    q, kc, vc, meta = _decode_step("g1_d64", DT, seed=2)
    from lamina.kernels.triton_attention import paged_attention_triton

    monkeypatch.setenv("LAMINA_DECODE_ATTN", "old")
    old = paged_attention_triton(q, kc, vc, meta, 64 ** -0.5)
    monkeypatch.setenv("LAMINA_DECODE_ATTN", "bogus")
    with pytest.raises(ValueError):
        paged_attention_triton(q, kc, vc, meta, 64 ** -0.5)
    monkeypatch.delenv("LAMINA_DECODE_ATTN")
    oracle = paged_attention_ref(q.float(), kc.float().nan_to_num(0), vc.float().nan_to_num(0), meta, 64 ** -0.5)
    assert rel_err(old, oracle) < TOL[DT]
    assert rel_err(paged_attention_triton(q, kc, vc, meta, 64 ** -0.5), oracle) < TOL[DT]


def test_packed_decode_padding_and_prefill_rows():
    """A mixed batch: the decode kernel must write only its query-length-1 rows; seq_len 0 rows get zeros."""
    from lamina.kernels import triton_decode_attention as tda
    from lamina.kernels.triton_attention_tile import LOG2E

    hq, hkv, d = 8, 2, 64
    q, k, v, kc, vc, meta = make_step([(1, 40), (5, 30), (1, 17)], hq, hkv, d, DT, seed=4)
    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    lens = [40, 30, 0]  # the last sequence becomes graph padding
    meta = AttentionMetadata(meta.slot_mapping, meta.query_start, torch.tensor(lens, dtype=torch.int32, device=DEV),
                             meta.block_tables, meta.query_start_cpu, lens, 5, 40)
    oracle = paged_attention_ref(q.float(), kc.float().nan_to_num(0), vc.float().nan_to_num(0), meta, d ** -0.5)
    for heads, splits, ahead in ((1, 1, False), (2, 4, True), (4, None, False)):
        out = torch.full_like(q, float("nan"))
        tda.decode_v2(q, kc, vc, out, meta, (d ** -0.5 * LOG2E, 0.0, 0, False, False), "tf32",
                      {"heads": heads, "ids_ahead": ahead}, splits, True)
        assert rel_err(out[:1], oracle[:1]) < TOL[DT]
        assert out[1:6].isnan().all(), "prefill rows belong to the prefill kernel"
        assert torch.equal(out[6:], torch.zeros_like(out[6:]))


def test_split_policy_depends_on_shapes_only():
    from lamina.kernels import triton_decode_attention as tda

    sms = 132
    assert tda.decode_splits(256, 8, sms) == 1  # 2048 programs: no partials, no combine pass
    assert tda.decode_splits(132, 8, sms) == 1
    assert tda.decode_splits(64, 8, sms) == 4
    assert tda.decode_splits(1, 8, sms) == tda.MAX_SPLITS
    assert tda.decode_splits(1, 1, sms, max_splits=256) == 256
    assert tda.decode_splits(0, 8, sms) == tda.MAX_SPLITS
    for b in range(1, 300):
        s = tda.decode_splits(b, 8, sms)
        assert s & (s - 1) == 0 and 1 <= s <= tda.MAX_SPLITS
        assert s == 1 or b * 8 * s >= tda.FILL * sms or s == tda.MAX_SPLITS
    assert tda.decode_regime(256, 8, sms) == "direct"
    assert tda.decode_regime(64, 8, sms) == "split"
    assert tda.decode_regime(1, 8, sms) == "wide"
    assert tda.decode_config(torch.bfloat16, 128, 256, 8, sms) == tda.DECODE_TABLE[("16", 128, "direct")]
    assert tda.decode_config(torch.float32, 64, 1, 8, sms).block_n == 32


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("heads", [1, 2])
def test_packed_decode_graph_replays_other_lengths(heads):
    hq, hkv, d, b, width = 16, 8, 128, 4, 64
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(b * width + 1, PAGE, hkv, d, generator=gen).bfloat16().to(DEV)
    vc = torch.randn(b * width + 1, PAGE, hkv, d, generator=gen).bfloat16().to(DEV)
    q = torch.randn(b, hq, d, generator=gen).bfloat16().to(DEV)
    qs = list(range(b + 1))
    meta = AttentionMetadata(torch.zeros(b, dtype=torch.int64, device=DEV), torch.tensor(qs, dtype=torch.int32,
                             device=DEV), torch.ones(b, dtype=torch.int32, device=DEV),
                             torch.zeros(b, width, dtype=torch.int32, device=DEV), qs, [1] * b, 1, 1)
    out = torch.empty_like(q)
    fn = lambda: _run(q, kc, vc, meta, heads=heads)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for lens in ([5, 1024, 17, 300], [1000, 1, 512, 999]):
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        meta.block_tables.copy_(torch.randperm(b * width, generator=gen).view(b, width).int())
        graph.replay()
        host = AttentionMetadata(meta.slot_mapping, meta.query_start, meta.seq_lens, meta.block_tables, qs, lens,
                                 1, max(lens))
        ref = paged_attention_ref(q.float(), kc.float(), vc.float(), host, d ** -0.5)
        assert rel_err(out, ref) < TOL[torch.bfloat16], lens
