"""Sliding-window-only models return the blocks that fell out of the window: a long sequence on a small pool
holds a bounded number of blocks, outputs still equal HF transformers', prefix caching still hits (with
the head of a cached chain evicted, too), and every block comes back."""
from __future__ import annotations

import pytest
import torch
from gemma_factory import WINDOW, gemma_hf_logprobs, make_gemma_checkpoint

from lamina import LLM, SamplingParams
from lamina.cache.block_allocator import BlockAllocator
from lamina.cache.prefix_cache import PrefixCache, chain_hash
from lamina.cache.sliding_window import drop_out_of_window, release_horizon, window_blocks
from lamina.cache.specs import FullAttentionSpec, SlidingWindowSpec

BS = 4


@pytest.fixture(scope="module")
def sliding_ckpt(tmp_path_factory, smol_tokenizer):
    return make_gemma_checkpoint(tmp_path_factory.mktemp("g3sw") / "m", "gemma3_text", smol_tokenizer, seed=7,
                                 sliding_only=True)


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": BS, "progress": False, **kw}
    return LLM(model=str(path), **kw)


def track_peak(llm: LLM) -> list[int]:
    """Records the most blocks leased at once (checked after every allocation)."""
    a, peak = llm.engine.allocator, [0]
    allocate = a.allocate

    def counted(n, after=None):
        out = allocate(n, after=after)
        peak[0] = max(peak[0], a.num_blocks - a.num_free)
        return out

    a.allocate = counted
    return peak


def all_free(llm: LLM) -> bool:
    a = llm.engine.allocator
    return a.num_free == a.num_blocks and not llm.engine.groups


def test_horizon_needs_every_kv_layer_sliding():
    sw = [SlidingWindowSpec(2, 16, torch.float32, 8), SlidingWindowSpec(2, 16, torch.float32, 5)]
    assert release_horizon(sw) == 8  # a block is dead only once the widest window left it
    assert release_horizon(sw + [FullAttentionSpec(2, 16, torch.float32)]) is None
    assert release_horizon([]) is None


def test_models_with_global_layers_keep_every_block_in_the_primary_table(tmp_path, smol_tokenizer):
    # Their sliding layers drop blocks from a table of their own instead (tests/test_window_group.py).
    path = make_gemma_checkpoint(tmp_path / "g2", "gemma2", smol_tokenizer)
    llm = make(path, num_kv_blocks=32)
    assert llm.engine.allocator.null_block is None and llm.engine.scheduler.window is None
    assert llm.engine.allocator.num_blocks == 32
    assert llm.engine.window_group is not None and llm.engine.window_group.window == WINDOW


def test_drop_frees_only_blocks_before_the_window():
    a = BlockAllocator(10, reserve_null=True)
    assert (a.num_blocks, a.null_block, a.num_free) == (9, 9, 9)

    class Seq:
        block_table = a.allocate(5)  # 20 tokens
        num_computed_tokens = 14

    seq, old = Seq(), list(Seq.block_table)
    # The next query (position 14) reads keys from 14 - 6 + 1 = 9: blocks 0 and 1 (tokens 0..7) are dead.
    assert drop_out_of_window(seq, a, BS, 6) == 2
    assert seq.block_table == [9, 9] + old[2:] and a.num_free == 6
    assert drop_out_of_window(seq, a, BS, 6) == 0  # idempotent
    a.free(seq.block_table[::-1])  # the null entries are skipped
    assert a.num_free == 9


def test_windowed_match_skips_evicted_head_blocks():
    a = BlockAllocator(20, reserve_null=True)
    pc = PrefixCache(a, BS, window=6)
    tokens = list(range(100, 125))  # 25 tokens: 6 usable full blocks

    class Seq:
        token_ids, block_hashes, num_tokens = tokens, [], len(tokens)

    hashes, parent = [], None
    for i in range(6):
        parent = chain_hash(parent, tokens[i * BS:(i + 1) * BS])
        hashes.append(parent)
    blocks = a.allocate(6)
    for b, h in zip(blocks, hashes):
        a.register(b, h)
    a.free(blocks)
    a.forget(blocks[:3])  # blocks 0..2 evicted: a full-attention cache could not hit at all
    found, _ = pc.match(Seq())
    # A 6-block prefix (24 tokens) needs keys from 24 - 6 + 1 = 19: blocks 4 and 5 only.
    assert found == [a.null_block] * 4 + blocks[4:6]
    assert a.ref_counts[blocks[4]] == 1 and a.ref_counts[blocks[3]] == 0
    a.forget(blocks[4:5])  # a hole inside the window: the deepest usable prefix is now shorter (none here)
    a.free(found)
    found, _ = pc.match(Seq())
    assert found == []
    a.free(found)
    assert a.num_free == a.num_blocks


def test_long_sequence_on_a_small_pool_matches_hf(sliding_ckpt):
    prompt = list(range(2000, 2030))
    chunk = 8
    pool = window_blocks(WINDOW, chunk, BS) + 2  # far fewer tokens than the sequence (32 < 30 + 70)
    llm = make(sliding_ckpt, num_kv_blocks=pool, max_num_batched_tokens=chunk)
    peak = track_peak(llm)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=70, logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    assert len(gen) == 70
    assert peak[0] <= window_blocks(WINDOW, chunk, BS) < (len(prompt) + 70) // BS
    ref = gemma_hf_logprobs(sliding_ckpt, prompt + gen)
    for i, tok in enumerate(gen):
        row = ref[len(prompt) + i - 1]
        assert tok == int(row.argmax()), f"greedy token {i} differs from HF"
        assert abs(out.outputs[0].logprobs[i][tok].logprob - row[tok].item()) <= 1e-4
    assert all_free(llm)


def test_prompt_logprobs_with_blocks_dropped_mid_prompt(sliding_ckpt):
    prompt = list(range(3000, 3041))
    ref = gemma_hf_logprobs(sliding_ckpt, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    llm = make(sliding_ckpt, num_kv_blocks=8, max_num_batched_tokens=5)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    assert (ours - ref).abs().max().item() <= 1e-4
    assert all_free(llm)


def test_prefix_cache_hits_after_blocks_were_dropped(sliding_ckpt):
    prompts = [{"prompt_token_ids": list(range(4000, 4030)) + [7 + i, 9, 11]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    off = make(sliding_ckpt, num_kv_blocks=64, enable_prefix_caching=False).generate(prompts, params,
                                                                                     use_tqdm=False)
    on = make(sliding_ckpt, num_kv_blocks=64, enable_prefix_caching=True, max_num_batched_tokens=8)
    outs = [on.generate(p, params, use_tqdm=False)[0] for p in prompts]  # one after the other: hits
    for a, b in zip(outs, off):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) <= 1e-4
    assert outs[1].num_cached_tokens >= 24 and outs[2].num_cached_tokens >= 24
    assert all_free(on)


def test_preemption_with_dropped_blocks_recomputes_the_same(sliding_ckpt):
    prompts = [{"prompt_token_ids": list(range(5000 + 100 * i, 5000 + 100 * i + 20 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = make(sliding_ckpt, num_kv_blocks=128).generate(prompts, params, use_tqdm=False)
    chunk = 8
    # Room for two sequences' windows at a time: the others are preempted and recomputed.
    small = make(sliding_ckpt, num_kv_blocks=2 * window_blocks(WINDOW, chunk, BS) + 1, max_num_batched_tokens=chunk)
    sched, preempted = small.engine.scheduler, []
    preempt = sched._preempt
    sched._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    outs = small.generate(prompts, params, use_tqdm=False)
    assert preempted  # the pool was small enough to force it
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in big]
    assert all_free(small)
