"""The CUDA-graph runner's host side on the CPU: which graph a step picks, how its batch is padded, and that
the captured body run on the padded batch gives the eager forward's logits (so padding is harmless) for
every step of real generations (chunked prefill mixed with decode rows, sliding windows, prompt logprobs).

The body runs through the torch reference here; the Triton kernels on the same padded metadata are checked in
tests/kernels/test_triton_graph_attention.py, and the captured graphs themselves by scripts/gpu_graph_check.py.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from model_factory import shared_prefix_prompts

from lamina import LLM, SamplingParams
from lamina.engine.cuda_graph import CudaGraphRunner
from lamina.engine.graph_keys import (
    GraphKey,
    choose_key,
    decode_batch_sizes,
    mixed_seq_slots,
    mixed_token_sizes,
    padding_waste,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)



@pytest.fixture(autouse=True)
def _hybrid_mixed_graphs(monkeypatch):
    """Hybrid mixed graphs are on by default: these tests check the default, whatever the caller's environment."""
    monkeypatch.delenv("LAMINA_HYBRID_MIXED_GRAPHS", raising=False)
    monkeypatch.delenv("LAMINA_MIXED_GRAPHS", raising=False)


def test_token_ladder():
    sizes = mixed_token_sizes(8192)
    assert len(sizes) == 56 and sizes[0] == 16 and sizes[-1] == 8192
    assert all(s % 16 == 0 for s in sizes) and sizes == sorted(set(sizes))
    # Above 128 tokens at most 1/8 of a graph's rows are padding; below, every multiple of 16 is there.
    for t in range(1, 8193):
        key = choose_key(t, 1, False, [1], sizes, 256)
        assert key.tokens >= t and (t <= 128 or padding_waste(t, key) <= 1 / 8 + 1e-9), t
    assert mixed_token_sizes(2048)[-1] == 2048 and len(mixed_token_sizes(2048)) == 40
    assert mixed_token_sizes(3000)[-1] == 3008 and mixed_token_sizes(5) == [16]
    assert len(mixed_token_sizes(8192, per_octave=4)) == 8 + 6 * 4


def test_choose_key():
    dec, mix = decode_batch_sizes(256), mixed_token_sizes(2048)
    assert choose_key(3, 3, True, dec, mix, 256) == GraphKey(4, 4, True)
    assert choose_key(200, 200, True, dec, mix, 256) == GraphKey(208, 208, True)
    assert choose_key(300, 300, True, dec, mix, 256) is None  # more sequences than any graph takes
    # max_num_seqs 512: decode steps past the largest decode graph replay a mixed graph.
    assert choose_key(300, 300, True, dec, mix, 512) == GraphKey(320, 320, False)
    assert choose_key(60, 5, False, dec, mix, 256) == GraphKey(64, 64, False)
    assert choose_key(700, 40, False, dec, mix, 256) == GraphKey(704, 257, False)
    # 20 sequences in 20 tokens cannot happen in a mixed step, but 20 in 21 can: a slot for the padding is left.
    assert choose_key(21, 20, False, dec, mix, 256) == GraphKey(32, 32, False)
    assert choose_key(17, 16, False, dec, mix, 16) == GraphKey(32, 17, False)
    assert choose_key(16, 16, False, dec, mix, 16) == GraphKey(32, 17, False)  # slots grow with the size
    assert choose_key(2049, 2, False, dec, mix, 256) is None
    # A few long contexts in a graph of many more slots would lose split-K: eager. Many sequences, or short
    # contexts, or a graph sized to the step: graph.
    assert choose_key(1000, 5, False, dec, mix, 256, max_seq_len=20000) is None
    assert choose_key(1000, 100, False, dec, mix, 256, max_seq_len=20000) == GraphKey(1024, 257, False)
    assert choose_key(1000, 5, False, dec, mix, 256, max_seq_len=4000) == GraphKey(1024, 257, False)
    assert choose_key(20, 12, False, dec, mix, 256, max_seq_len=20000) == GraphKey(32, 32, False)
    assert choose_key(5, 5, True, dec, mix, 256, max_seq_len=20000) == GraphKey(8, 8, True)
    assert mixed_seq_slots(16, 256) == 16 and mixed_seq_slots(4096, 256) == 257


class _Stub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=8)
        self.w = torch.nn.Parameter(torch.zeros(1))


def test_hybrid_models_get_mixed_graphs_too(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("LAMINA_HYBRID_MIXED_GRAPHS", "0")  # the switch that turns them off for hybrid models only
    assert CudaGraphRunner(_Stub(), 8, 64, 4, cpu, padding_slot=8, max_num_batched_tokens=64).mixed_sizes == []
    assert CudaGraphRunner(_Stub(), 8, 64, 4, cpu, max_num_batched_tokens=64).mixed_sizes == [16, 32, 48, 64]
    monkeypatch.delenv("LAMINA_HYBRID_MIXED_GRAPHS")  # the default: on
    hybrid = CudaGraphRunner(_Stub(), 8, 64, 4, cpu, padding_slot=8, max_num_batched_tokens=64)
    assert hybrid.mixed_sizes == [16, 32, 48, 64]
    assert [(k.tokens, k.seqs, k.decode) for k in hybrid.keys if not k.decode] == \
        [(16, 9, False), (32, 9, False), (48, 9, False), (64, 9, False)]
    # every sequence slot of every graph can point at the padding slot; the state pool has 8 + 1 rows
    assert hybrid.state_slots.shape == (9,) and hybrid.state_slots.eq(8).all()
    assert not hybrid.inputs.has_initial_state.any()
    assert CudaGraphRunner(_Stub(), 8, 64, 4, cpu, max_num_batched_tokens=64).mixed_sizes == [16, 32, 48, 64]
    assert CudaGraphRunner(_Stub(), 8, 64, 4, cpu, max_num_batched_tokens=64, mixed=False).mixed_sizes == []
    monkeypatch.setenv("LAMINA_MIXED_GRAPHS", "0")
    assert CudaGraphRunner(_Stub(), 8, 64, 4, cpu, max_num_batched_tokens=64).mixed_sizes == []


class CheckedGraphs(CudaGraphRunner):
    """Runs the graph body eagerly on the padded batch, checks it against the unpadded forward and returns
    the body's logits (so generation goes through the padded path end to end)."""

    def __init__(self, *a, state_pool=None, **kw):
        super().__init__(*a, **kw)
        self.used: list[tuple[int, GraphKey]] = []
        self.worst = 0.0
        self.state_pool = state_pool  # recurrent state advances per forward: restored between the two runs

    def run(self, batch):
        key = self.pick(batch)
        pool = [t for pair in self.state_pool.tensors for t in pair] if self.state_pool is not None else []
        before = [t.clone() for t in pool]
        logits = self.run_eager(batch, key)
        after = [t.clone() for t in pool]
        for t, b in zip(pool, before):
            t.copy_(b)
        with torch.inference_mode():
            ref = self.model(batch.input_ids, batch.positions, batch.ctx, batch.logits_indices)
        pad = self.padding_slot
        for t, a in zip(pool, after):  # real slots end equal; padded rows wrote only the padding slot
            assert torch.allclose(t[:pad], a[:pad], atol=1e-5), (t[:pad] - a[:pad]).abs().max()
        assert logits.shape == ref.shape
        if ref.numel():  # a step of prompt chunks that sample nothing has no logits rows
            self.worst = max(self.worst, (logits - ref).abs().max().item())
        self.used.append((batch.input_ids.shape[0], key))
        return logits


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 60))]} for _ in range(n)]


def _llm(path, **kw):
    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "progress": False, "num_kv_blocks": 256, **kw}
    return LLM(model=str(path), **kw)


@pytest.mark.parametrize("family,overlap", [("llama", False), ("qwen3", True), ("mistral", True), ("qwen2", False)])
def test_padded_body_equals_eager_forward(checkpoints, family, overlap, one_thread):
    params = [GREEDY] * 7 + [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1)]
    eager = _llm(checkpoints[family], max_num_batched_tokens=24, max_num_seqs=6, async_scheduling=overlap)
    want = eager.generate(_prompts(8), params, use_tqdm=False)

    llm = _llm(checkpoints[family], max_num_batched_tokens=24, max_num_seqs=6, async_scheduling=overlap)
    eng = llm.engine
    eng.runner.graphs = graphs = CheckedGraphs(eng.model, 6, eng.max_model_len, 4, eng.device,
                                               max_num_batched_tokens=24)
    got = llm.generate(_prompts(8), params, use_tqdm=False)

    assert graphs.worst < 1e-4, graphs.worst
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want):
        for la, lb in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
    assert got[-1].prompt_logprobs is not None and len(got[-1].prompt_logprobs) == len(want[-1].prompt_logprobs)
    kinds = {k.decode for _, k in graphs.used}
    assert kinds == {True, False}, "both decode and mixed graphs must have been used"
    assert any(k.tokens > t for t, k in graphs.used if not k.decode), "some mixed step was padded"
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.groups


@pytest.fixture(scope="module")
def hybrid_ckpts(tmp_path_factory, smol_tokenizer):
    from hybrid_helpers import hybrid_checkpoints

    return hybrid_checkpoints(tmp_path_factory, smol_tokenizer)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_padded_body_equals_eager_forward_moe_and_hybrid(hybrid_ckpts, family, one_thread):
    """MoE with attention only, and hybrid (gated delta net): every step through the padded body (hybrid:
    padded rows on the state pool's padding slot, which alone may change)."""
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)] * 6
    kw = {"max_num_batched_tokens": 32, "max_num_seqs": 6, "async_scheduling": True}
    want = _llm(hybrid_ckpts[family], **kw).generate(_prompts(6, seed=1), params, use_tqdm=False)
    llm = _llm(hybrid_ckpts[family], **kw)
    eng = llm.engine
    pad = eng.state_pool.padding_slot if eng.state_pool is not None else None
    eng.runner.graphs = graphs = CheckedGraphs(eng.model, 6, eng.max_model_len, 4, eng.device, pad,
                                               max_num_batched_tokens=32, state_pool=eng.state_pool)
    got = llm.generate(_prompts(6, seed=1), params, use_tqdm=False)
    assert graphs.worst < 1e-4, graphs.worst
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    kinds = {k.decode for _, k in graphs.used}
    assert kinds == {True, False}
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.groups
    assert pad is None or eng.state_pool.num_free == eng.state_pool.num_slots


def test_hybrid_prefix_cache_through_padded_body(hybrid_ckpts, one_thread):
    """Prefix caching on a hybrid model with every step through the padded graph body: snapshot steps (chunks
    cut at snapshot positions) and steps after a restore give the cache-off tokens, snapshots hit, and every
    block, slot and snapshot row comes back."""
    prompts = shared_prefix_prompts(3, per_group=3, prefix_len=26)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = {"max_num_batched_tokens": 32, "max_num_seqs": 6}
    want = _llm(hybrid_ckpts["qwen3_next"], enable_prefix_caching=False, **kw).generate(prompts, params,
                                                                                        use_tqdm=False)
    llm = _llm(hybrid_ckpts["qwen3_next"], enable_prefix_caching=True, state_snapshot_interval=8, **kw)
    eng = llm.engine
    eng.runner.graphs = graphs = CheckedGraphs(eng.model, 6, eng.max_model_len, 4, eng.device,
                                               eng.state_pool.padding_slot, max_num_batched_tokens=32,
                                               state_pool=eng.state_pool)
    for _ in range(2):  # the second round finds every prefix cached
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert graphs.worst < 1e-4 and {k.decode for _, k in graphs.used} == {True, False}
    assert eng.stats().num_snapshot_hits > 0
    snaps = eng.snapshots
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.groups
    assert eng.state_pool.num_free == eng.state_pool.num_slots
    assert snaps.num_used + snaps.num_free == snaps.num_snapshots
