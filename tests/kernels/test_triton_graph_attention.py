"""Paged attention on the exact padded metadata a CUDA graph replays with (graph_inputs.GraphInputs), against
the torch reference on the unpadded step: real rows match, padding rows are zeros, padding writes no KV.

Runs on a GPU or through Triton's interpreter (fp16/fp32 there, see test_triton_kernels.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_helpers import DEV, INTERPRET, TOL, rel_err
from test_triton_kernels import make_step

from lamina.engine.graph_inputs import GraphInputs
from lamina.engine.graph_keys import (
    GraphKey,
    choose_key,
    decode_batch_sizes,
    mixed_token_sizes,
)
from lamina.kernels.attention import paged_attention_ref, store_kv_ref
from lamina.kernels.metadata import StepContext

# (query_len, seq_len) per sequence, in scheduled order: decode rows anywhere, chunks with and without prefix.
CASES = {
    "mixed_interleaved": ([(1, 40), (37, 37), (1, 3), (20, 90), (1, 70)], 8, 2, 64, None),
    "mixed_window_g7": ([(33, 80), (1, 65), (1, 2)], 14, 2, 64, 24),
    "prefill_only": ([(50, 50), (17, 60)], 4, 4, 32, None),
    "decode_only": ([(1, 33), (1, 100), (1, 7)], 8, 2, 64, None),
}
PARAMS = [(c, torch.float16) for c in CASES] + [("mixed_interleaved", torch.float32)]
if not INTERPRET:
    PARAMS += [(c, torch.bfloat16) for c in CASES]


def _graph_step(specs, hq, hkv, d, dtype, max_num_seqs, extra_pad=0):
    q, k, v, kc, vc, meta = make_step(specs, hq, hkv, d, dtype, seed=len(specs) + hq)
    t, b = q.shape[0], meta.num_seqs
    key = choose_key(t, b, meta.is_decode_only, decode_batch_sizes(max_num_seqs), mixed_token_sizes(256),
                     max_num_seqs)
    assert key is not None and key.tokens >= t
    if extra_pad:  # more padding rows than any tile holds (negative prefixes must read nothing)
        key = GraphKey(key.tokens + extra_pad, key.seqs + 2, False)
    inputs = GraphInputs(512, max_num_seqs + 3, meta.block_tables.shape[1] + 3, DEV)
    # Stale garbage from earlier steps must not matter: poison what load() leaves alone.
    inputs.block_tables.fill_(10**6)
    inputs.mixed_query_start.fill_(7)
    batch = SimpleNamespace(input_ids=torch.zeros(t, dtype=torch.long, device=DEV),
                            positions=torch.zeros(t, dtype=torch.long, device=DEV), ctx=StepContext(meta))
    inputs.load(batch, key)
    gmeta = inputs.context(key, max_model_len=4096).attn
    pad = key.tokens - t
    gen = torch.Generator().manual_seed(1)
    q_pad = torch.cat([q, torch.randn(pad, hq, d, generator=gen).to(dtype).to(DEV)])
    k_pad = torch.cat([k, torch.randn(pad, hkv, d, generator=gen).to(dtype).to(DEV)])
    v_pad = torch.cat([v, torch.randn(pad, hkv, d, generator=gen).to(dtype).to(DEV)])
    return q, k, v, kc, vc, meta, key, gmeta, q_pad, k_pad, v_pad


@pytest.mark.parametrize("case,dtype,extra_pad", [(c, d, 0) for c, d in PARAMS] + [
    ("mixed_interleaved", torch.float16, 150), ("mixed_window_g7", torch.float16, 130),
    ("decode_only", torch.float16, 20)],  # a decode step on a mixed graph (past the largest decode graph)
    ids=[f"{c}-{str(d)[6:]}" for c, d in PARAMS] + ["wide_padding", "wide_padding_window", "decode_on_mixed"])
@pytest.mark.parametrize("max_num_seqs", [8, 64])
def test_attention_on_padded_graph_metadata(case, dtype, extra_pad, max_num_seqs):
    from lamina.kernels.triton_attention import paged_attention_triton, store_kv_triton

    specs, hq, hkv, d, window = CASES[case]
    q, k, v, kc, vc, meta, key, gmeta, q_pad, k_pad, v_pad = _graph_step(specs, hq, hkv, d, dtype, max_num_seqs,
                                                                         extra_pad)
    t = q.shape[0]
    assert key.decode == (meta.is_decode_only and not extra_pad)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv_ref(k, v, kc_ref, vc_ref, meta.slot_mapping)
    store_kv_triton(k_pad, v_pad, kc, vc, gmeta.slot_mapping)
    for a, b in ((kc, kc_ref), (vc, vc_ref)):  # padding rows wrote nothing
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))
    scale = d ** -0.5
    oracle = paged_attention_ref(q.float(), kc.float().nan_to_num(0), vc.float().nan_to_num(0), meta, scale, window)
    splits = (None, 4) if dtype != torch.float32 else (None,)
    for s in splits:
        out = paged_attention_triton(q_pad, kc, vc, gmeta, scale, window, out=torch.full_like(q_pad, float("nan")),
                                     num_splits=s, poison_workspace=True)
        assert rel_err(out[:t], oracle) < TOL[dtype], (s, rel_err(out[:t], oracle))
        assert torch.equal(out[t:], torch.zeros_like(out[t:])), "padding rows must come out as zeros"


def test_padded_reference_matches_unpadded():
    """The reference on the padded batch (exact host fields) equals it on the step: the CPU tests of the graph
    body rely on this."""
    specs, hq, hkv, d, window = CASES["mixed_interleaved"]
    q, k, v, kc, vc, meta, key, _, q_pad, _, _ = _graph_step(specs, hq, hkv, d, torch.float32, 8)
    inputs_meta = _exact(meta, key)
    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    kc, vc = kc.nan_to_num(0), vc.nan_to_num(0)
    ref = paged_attention_ref(q, kc, vc, meta, d ** -0.5, window)
    padded = paged_attention_ref(q_pad, kc, vc, inputs_meta, d ** -0.5, window)
    t = q.shape[0]
    assert torch.equal(padded[:t], ref) and torch.equal(padded[t:], torch.zeros_like(padded[t:]))


def _exact(meta, key: GraphKey):
    inputs = GraphInputs(256, 9, meta.block_tables.shape[1], DEV)
    t = meta.query_start_cpu[-1]
    batch = SimpleNamespace(input_ids=torch.zeros(t, dtype=torch.long, device=DEV),
                            positions=torch.zeros(t, dtype=torch.long, device=DEV), ctx=StepContext(meta))
    inputs.load(batch, key)
    return inputs.context(key, 4096, exact_host=True).attn
