"""Hybrid verify graphs on the CPU: the keys and the padding a verify step gets (real sequences, padding
sequences of at most K + 1 rows, empty slots; every padded candidate entry on the padding slot), and whole
generations with every verify step through the padded verify-graph body (torch reference, exact host fields):
greedy tokens as without speculation, every real state slot (own and candidate) as the unpadded forward left
it, so the rollback still copies the per-position state. Graphs that are not verify graphs never take a hybrid
verify step (they would leave the candidate states unwritten). The captured graphs themselves:
scripts/gpu_spec_bench.py, stage `graphs`."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hybrid_helpers import make_hybrid_checkpoint
from spec_helpers import GREEDY64, OracleProposer, make, outputs, spec_prompts, with_proposer

from lamina.engine.cuda_graph import CudaGraphRunner
from lamina.engine.graph_inputs import GraphInputs
from lamina.engine.graph_keys import (
    GraphKey,
    choose_verify_key,
    decode_batch_sizes,
    verify_keys,
    verify_padding_seqs,
    verify_padding_starts,
)
from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.metadata import StateMetadata, StepContext

K = 3


def test_verify_keys_and_choice():
    dec = decode_batch_sizes(64)
    keys = verify_keys(dec, K + 1)
    assert keys[0] == GraphKey(4, 2, False, 4) and keys[-1] == GraphKey(256, 128, False, 4) and len(keys) == len(dec)
    assert verify_keys(dec, 1) == [] and choose_verify_key(3, 4, dec, 1) is None
    assert choose_verify_key(3, 4, dec, 4) == GraphKey(16, 8, False, 4)
    assert choose_verify_key(1, 2, dec, 4) == GraphKey(4, 2, False, 4)
    assert choose_verify_key(3, 5, dec, 4) is None  # a chunk longer than K + 1: not a verify graph's step
    assert choose_verify_key(65, 4, dec, 4) is None
    # padding rows in sequences of at most K + 1 rows, and enough slots for them whatever the drafts
    for b in dec[:5]:
        for n in range(1, b + 1):
            key = choose_verify_key(n, 4, dec, 4)
            for t in range(n + 1, n * 4 + 1):
                starts = verify_padding_starts(t, n, key)
                assert len(starts) == key.seqs - n and starts[-1] == key.tokens
                lens = [e - s for s, e in zip([t] + starts, starts)]
                assert all(0 <= x <= 4 for x in lens) and sum(lens) == key.tokens - t
                assert sum(1 for x in lens if x) == verify_padding_seqs(t, key)


def _batch(lens, seq_lens, slots, cands, init):
    """A hand-made verify step (what runner.prepare builds): sequences of `lens` rows."""
    qs = [0]
    for n in lens:
        qs.append(qs[-1] + n)
    t, b = qs[-1], len(lens)
    width = max(1, max(lens) - 1)
    table = torch.zeros(b, width, dtype=torch.long)
    for i, c in enumerate(cands):
        table[i, :len(c)] = torch.tensor(c, dtype=torch.long)
    attn = AttentionMetadata(torch.arange(t), torch.tensor(qs, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), torch.ones(b, 3, dtype=torch.int32), qs,
                             seq_lens, max(lens), max(seq_lens))
    state = StateMetadata(torch.tensor(slots), torch.tensor(init), slots, init, cands, table)
    return SimpleNamespace(input_ids=torch.arange(t) + 100, positions=torch.arange(t), ctx=StepContext(attn, state))


def test_padding_of_a_verify_step():
    pad = 20
    inputs = GraphInputs(64, 16, 4, torch.device("cpu"), padding_slot=pad, verify_width=4)
    batch = _batch([4, 1, 3], [9, 5, 7], [2, 5, 7], [[10, 11, 12], [], [13, 14]], [True, True, False])
    key = choose_verify_key(3, 4, decode_batch_sizes(8), 4)
    assert key == GraphKey(16, 8, False, 4) and inputs.fits(batch, key)
    inputs.load(batch, key)
    assert inputs.mixed_query_start[:9].tolist() == [0, 4, 5, 8] + verify_padding_starts(8, 3, key)
    assert inputs.mixed_query_start[:9].tolist() == [0, 4, 5, 8, 12, 16, 16, 16, 16]
    assert inputs.num_seqs.item() == 5  # three sequences and two of padding rows
    # the runner's table as it is (entries past a row's L_b - 1 are never read), then the padding slot
    assert inputs.candidates[:3].tolist() == [[10, 11, 12], [0, 0, 0], [13, 14, 0]]
    assert inputs.candidates[3:8].eq(pad).all() and inputs.state_slots[3:8].eq(pad).all()
    assert inputs.seq_lens[:8].tolist() == [9, 5, 7, 0, 0, 0, 0, 0]
    assert not inputs.has_initial_state[3:8].any() and inputs.slot_mapping[8:16].eq(-1).all()
    ctx = inputs.context(key, 64, exact_host=True)
    assert ctx.attn.max_query_len == 4 and ctx.state.candidate_slots.shape == (8, 3)
    assert ctx.state.candidate_slots_cpu == [[10, 11, 12], [], [13, 14], [pad] * 3, [pad] * 3, [], [], []]
    graph_ctx = inputs.context(key, 64)  # what a capture sees: host fields of the key only
    assert graph_ctx.attn.max_query_len == 4 and graph_ctx.attn.query_start_cpu == []
    assert graph_ctx.state.candidate_slots is not None and graph_ctx.state.candidate_slots_cpu is not None
    # a verify step never goes to another graph, nor a plain step to a verify graph
    assert not inputs.fits(batch, GraphKey(16, 9, False)) and not inputs.fits(batch, GraphKey(4, 4, True))
    plain = _batch([1, 1], [3, 4], [1, 2], [[], []], [True, True])
    plain.ctx = StepContext(plain.ctx.attn, StateMetadata(plain.ctx.state.slots, plain.ctx.state.has_initial_state,
                                                          [1, 2], [True, True]))
    assert not inputs.fits(plain, GraphKey(8, 4, False, 4)) and inputs.fits(plain, GraphKey(2, 2, True))
    # a verify step next to a prefill chunk has no device candidate table: eager
    mixed = _batch([4, 9], [9, 9], [1, 2], [[3, 4, 5], []], [True, False])
    mixed.ctx = StepContext(mixed.ctx.attn, StateMetadata(mixed.ctx.state.slots, mixed.ctx.state.has_initial_state,
                                                          [1, 2], [True, False], [[3, 4, 5], []], None))
    assert choose_verify_key(2, 9, decode_batch_sizes(8), 4) is None
    assert not inputs.fits(mixed, GraphKey(16, 8, False, 4))
    inputs.reset(key)  # what a capture runs on: padding sequences only
    assert inputs.mixed_query_start[:9].tolist() == [0, 4, 8, 12, 16, 16, 16, 16, 16] and inputs.num_seqs.item() == 4


class VerifyChecked(CudaGraphRunner):
    """Every step through the padded graph body (torch reference, exact host fields) against the unpadded
    forward: logits, and every real state slot (the padding slot alone may differ)."""

    def __init__(self, *a, state_pool, **kw):
        super().__init__(*a, **kw)
        self.state_pool, self.used, self.worst, self.eager = state_pool, [], 0.0, 0

    def run(self, batch):
        key = self.pick(batch)
        pool = [t for pair in self.state_pool.tensors for t in pair]
        before = [t.clone() for t in pool]
        logits = self.run_eager(batch, key)
        after = [t.clone() for t in pool]
        for t, b in zip(pool, before):
            t.copy_(b)
        with torch.inference_mode():
            ref = self.model(batch.input_ids, batch.positions, batch.ctx, batch.logits_indices)
        pad = self.padding_slot
        for t, a in zip(pool, after):
            assert torch.allclose(t[:pad], a[:pad], atol=1e-5), ("state", key, (t[:pad] - a[:pad]).abs().max())
        if ref.numel():
            self.worst = max(self.worst, (logits - ref).abs().max().item())
        self.used.append(key)
        return logits


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, smol_tokenizer, one_thread):
    path = make_hybrid_checkpoint(tmp_path_factory.getbasetemp() / "hybrid_ckpt" / "qwen3_next", "qwen3_next",
                                  smol_tokenizer, seed=10)
    ps = spec_prompts(5, seed=31)
    return path, ps, outputs(make(path), ps, GREEDY64)


def _with_graphs(llm, verify_width):
    eng = llm.engine
    eng.runner.graphs = graphs = VerifyChecked(eng.model, eng.config.max_num_seqs, eng.max_model_len, 4, eng.device,
                                               eng.state_pool.padding_slot, eng.config.max_num_batched_tokens,
                                               state_pool=eng.state_pool, verify_width=verify_width)
    return graphs


@pytest.mark.parametrize("drafts", ["all right", "all wrong", "ngram"])
def test_hybrid_verify_steps_through_verify_graphs(hybrid, drafts):
    path, ps, ref = hybrid
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "state_snapshot_interval": 8}
    if drafts == "ngram":
        llm = make(path, speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                                             "min_acceptance_rate": 0}, **kw)
    else:
        llm = with_proposer(make(path, **kw), OracleProposer(ps, ref, drafts == "all wrong"), K)
    graphs = _with_graphs(llm, K + 1)
    assert outputs(llm, ps, GREEDY64) == ref
    assert graphs.worst < 1e-4, graphs.worst
    verify = [k for k in graphs.used if k.verify]
    assert verify and all(k.verify == K + 1 for k in verify)
    assert any(k.decode for k in graphs.used) or drafts != "ngram"
    st = llm.engine.stats()
    assert st.num_spec_draft_tokens > 0
    assert st.num_spec_accepted_tokens == {"all right": st.num_spec_draft_tokens, "all wrong": 0}.get(
        drafts, st.num_spec_accepted_tokens)
    eng = llm.engine
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.groups
    assert eng.state_pool.num_free == eng.state_pool.num_slots


def test_without_verify_graphs_verify_steps_run_eagerly(hybrid):
    """A graph runner without verify graphs (LAMINA_HYBRID_VERIFY_GRAPHS=0, or a failed capture) runs hybrid
    verify steps eagerly: no decode or mixed graph takes them."""
    path, ps, ref = hybrid
    llm = with_proposer(make(path, max_num_seqs=4, max_num_batched_tokens=32), OracleProposer(ps, ref, True), K)
    graphs = _with_graphs(llm, 0)
    picked = []
    orig = graphs.pick
    graphs.pick = lambda batch: picked.append((batch.ctx.state.candidate_slots_cpu is not None, orig(batch))) \
        or picked[-1][1]
    assert outputs(llm, ps, GREEDY64) == ref
    assert any(v for v, _ in picked) and all(k is None for v, k in picked if v)
    assert all(not k.verify for k in graphs.used)


def test_build_graphs_passes_the_verify_width(monkeypatch):
    from lamina.engine import build

    seen = {}

    class Fake:
        def __init__(self, *a, verify_width=0, **kw):
            seen["width"] = verify_width

        def capture(self):
            pass

    monkeypatch.setattr("lamina.engine.cuda_graph.CudaGraphRunner", Fake)
    monkeypatch.setattr(build, "triton_available", lambda: True)
    cfg = SimpleNamespace(enforce_eager=False, max_num_seqs=4, block_size=4, max_num_batched_tokens=32,
                          speculative_config=SimpleNamespace(num_speculative_tokens=3))
    pool = SimpleNamespace(padding_slot=7)
    model = torch.nn.Linear(1, 1)
    build.build_graphs(cfg, model, 64, pool, SimpleNamespace(type="cuda"))
    assert seen["width"] == 4
    build.build_graphs(cfg, model, 64, None, SimpleNamespace(type="cuda"))  # dense: verify steps use mixed graphs
    assert seen["width"] == 0
    monkeypatch.setenv("LAMINA_HYBRID_VERIFY_GRAPHS", "0")
    build.build_graphs(cfg, model, 64, pool, SimpleNamespace(type="cuda"))
    assert seen["width"] == 0
