"""Prefix caching for hybrid models (recurrent-state snapshots): outputs with the cache equal outputs without
it, hits land where snapshots are, and every block, slot and snapshot row is accounted for at the end."""
from __future__ import annotations

import pytest
from hybrid_helpers import FAMILIES, make_hybrid_checkpoint
from model_factory import shared_prefix_prompts

from lamina import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BS, INTERVAL = 4, 8


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def ckpt(request, tmp_path_factory, smol_tokenizer):
    # Same path and seed as hybrid_checkpoints(), so a session running both files builds each model once.
    family = request.param
    seed = 10 + list(FAMILIES).index(family)
    return make_hybrid_checkpoint(tmp_path_factory.getbasetemp() / "hybrid_ckpt" / family, family, smol_tokenizer,
                                  seed=seed)


def make(path, cache: bool, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": BS, "num_kv_blocks": 256, "max_num_seqs": 8,
          "progress": False, "enable_prefix_caching": cache, "state_snapshot_interval": INTERVAL, **kw}
    return LLM(model=str(path), **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def all_free(llm: LLM) -> bool:
    eng = llm.engine
    snaps = eng.snapshots
    return eng.allocator.num_free == eng.allocator.num_blocks and eng.state_pool.num_free == eng.state_pool.num_slots \
        and not eng.scheduler.running and not eng.scheduler.waiting and not eng.groups \
        and (snaps is None or snaps.num_used + snaps.num_free == snaps.num_snapshots)


def test_repeated_prompt_hits_at_last_snapshot(ckpt):
    llm = make(ckpt, True)
    off = make(ckpt, False)
    pc, snaps = llm.engine.prefix_cache, llm.engine.snapshots
    p = {"prompt_token_ids": list(range(2000, 2019))}  # 19 tokens: snapshots at 8 and 16 (interval, last block)
    ref = tokens(off.generate(p, GREEDY, use_tqdm=False))
    assert tokens(llm.generate(p, GREEDY, use_tqdm=False)) == ref
    assert (pc.queried_tokens, pc.hit_tokens, snaps.saves, snaps.hits) == (19, 0, 2, 0)
    out = llm.generate(p, GREEDY, use_tqdm=False)
    assert tokens(out) == ref and out[0].num_cached_tokens == 16 and snaps.hits == 1
    assert llm.engine.stats().num_snapshot_hits == 1
    # Block-aligned prompt: one token must be computed, so the deepest usable snapshot is at 12.
    q = {"prompt_token_ids": list(range(3000, 3016))}
    ref = tokens(off.generate(q, GREEDY, use_tqdm=False))
    assert tokens(llm.generate(q, GREEDY, use_tqdm=False)) == ref
    out = llm.generate(q, GREEDY, use_tqdm=False)
    assert tokens(out) == ref and out[0].num_cached_tokens == 12 and snaps.hits == 2
    # Same first 10 tokens, then different: KV matches 2 blocks, the snapshot at 8 is the deepest state.
    r = {"prompt_token_ids": list(range(2000, 2010)) + [5, 6, 7, 8, 9]}
    out = llm.generate(r, GREEDY, use_tqdm=False)
    assert tokens(out) == tokens(off.generate(r, GREEDY, use_tqdm=False)) and out[0].num_cached_tokens == 8
    assert all_free(llm)


def test_multi_turn_conversation(ckpt):
    on, off = make(ckpt, True), make(ckpt, False)
    history_on = history_off = list(range(7, 20))
    prev_len = 0  # length of the previous turn's prompt
    for turn in range(4):
        a = on.generate({"prompt_token_ids": history_on}, GREEDY, use_tqdm=False)[0]
        b = off.generate({"prompt_token_ids": history_off}, GREEDY, use_tqdm=False)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if turn:  # the previous prompt's last full block (a snapshot) is always reusable
            prev_last = (prev_len - 1) // BS * BS
            assert a.num_cached_tokens >= prev_last
        prev_len = len(history_on)
        user = [1000 + turn * 10 + i for i in range(5)]
        history_on = history_on + a.outputs[0].token_ids + user
        history_off = history_off + b.outputs[0].token_ids + user
    assert on.engine.snapshots.hits == 3
    assert all_free(on)


def test_concurrent_shared_prefixes_with_chunked_prefill(ckpt):
    prompts = shared_prefix_prompts(2)
    off = tokens(make(ckpt, False, max_num_batched_tokens=16).generate(prompts, GREEDY, use_tqdm=False))
    llm = make(ckpt, True, max_num_batched_tokens=16)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == off  # hits within the batch, if any
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(again) == off
    # Every prompt is cached up to its last full block (>= 20 of the 23..30 tokens).
    assert all(o.num_cached_tokens >= 20 for o in again)
    assert all_free(llm)


def test_eviction_under_small_pools(ckpt):
    prompts = shared_prefix_prompts(n_groups=4, per_group=3, prefix_len=26, seed=3)
    kw = dict(num_kv_blocks=40, max_num_batched_tokens=16, num_state_snapshots=3, max_num_seqs=4)
    off = tokens(make(ckpt, False, **kw).generate(prompts, GREEDY, use_tqdm=False))
    llm = make(ckpt, True, **kw)
    for _ in range(2):  # the second round finds some prefixes evicted, some not
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == off
    snaps = llm.engine.snapshots
    assert snaps.evictions > 0 and snaps.num_used <= 3
    assert all_free(llm)


def test_eviction_prefers_deep_recent_snapshots(ckpt):
    llm = make(ckpt, True, num_state_snapshots=2)
    snaps = llm.engine.snapshots
    long = {"prompt_token_ids": list(range(4000, 4033))}  # snapshots at 8, 16, 24, 32: only 2 rows
    llm.generate(long, GREEDY, use_tqdm=False)
    # Positions 8 and 16 were evicted first (older and shallower); 24 and 32 remain.
    assert snaps.positions() == [24, 32]
    out = llm.generate(long, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    assert all_free(llm)


def test_prefix_caching_off_allocates_no_snapshots(ckpt):
    llm = make(ckpt, False)
    assert llm.engine.snapshots is None and llm.engine.prefix_cache is None


def test_snapshot_interval_must_be_block_multiple(ckpt):
    with pytest.raises(ValueError, match="multiple of"):
        make(ckpt, True, state_snapshot_interval=6)


def test_default_snapshot_count_is_capped_by_device_memory():
    from lamina.engine.memory import default_num_snapshots

    assert default_num_snapshots(256, 1 << 20, None) == 512  # CPU: two per sequence slot
    # Qwen3-Next-80B-like: 77 MB per snapshot on a 141 GB device -> 10% of memory, not 2 x 256 (39 GB).
    assert default_num_snapshots(256, 77 * 10**6, 141 * 10**9) == 183
    assert default_num_snapshots(4, 1 << 20, 141 * 10**9) == 8
    assert default_num_snapshots(256, 10**12, 10**9) == 1  # never zero: prefix caching needs one row
