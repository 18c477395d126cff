"""Models interleaving sliding-window and full layers (Gemma 2/3) keep their sliding layers' KV in a pool of its
own (cache/kv_groups.py): a long sequence frees the window group's blocks that fell out of the window while the
full layers keep every block, outputs still equal HF transformers' (fp32, chunks cutting inside windows),
prefix caching on == off and still hits, preemption recomputes the same, and every block of both pools
comes back."""
from __future__ import annotations

import pytest
import torch
from gemma_factory import WINDOW, gemma_hf_logprobs, make_gemma_checkpoint

from lamina import LLM, SamplingParams
from lamina.cache.block_allocator import BlockAllocator
from lamina.cache.kv_groups import WindowGroup, mixed_window, window_pool_blocks, windowed_layers
from lamina.cache.prefix_cache import PrefixCache, chain_hash
from lamina.cache.sliding_window import window_blocks
from lamina.cache.specs import FullAttentionSpec, SlidingWindowSpec

BS = 4


@pytest.fixture(scope="module", params=["gemma3_text", "gemma2"])
def mixed_ckpt(request, tmp_path_factory, smol_tokenizer):
    return make_gemma_checkpoint(tmp_path_factory.mktemp(request.param) / "m", request.param, smol_tokenizer,
                                 seed=3)


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": BS, "progress": False, **kw}
    return LLM(model=str(path), **kw)


def track_peak(a: BlockAllocator) -> list[int]:
    """Records the most blocks of `a` leased at once (checked after every allocation)."""
    peak = [0]
    allocate = a.allocate

    def counted(n, after=None):
        out = allocate(n, after=after)
        peak[0] = max(peak[0], a.num_blocks - a.num_free)
        return out

    a.allocate = counted
    return peak


def all_free(llm: LLM) -> bool:
    e = llm.engine
    w = e.window_group.allocator
    return e.allocator.num_free == e.allocator.num_blocks and w.num_free == w.num_blocks and not e.groups


def test_groups_from_specs():
    full, sw8, sw5 = (FullAttentionSpec(2, 16, torch.float32), SlidingWindowSpec(2, 16, torch.float32, 8),
                      SlidingWindowSpec(2, 16, torch.float32, 5))
    assert mixed_window([sw8, full, sw5]) == 8 and windowed_layers([sw8, full, sw5]) == [True, False, True]
    assert mixed_window([sw8, sw5]) is None and windowed_layers([sw8, sw5]) == [False, False]  # one table
    assert mixed_window([full]) is None and mixed_window([]) is None
    # window 6, blocks of 4: a query at p with n new tokens spans at most floor((4 + n) / 4) + 2 blocks.
    assert window_pool_blocks(6, 4, 2, 8) == 2 * (4 // 4 + 3) + 2 + 1


def test_engine_binds_sliding_layers_to_their_own_pool(mixed_ckpt):
    llm = make(mixed_ckpt, num_kv_blocks=40, max_num_seqs=2, max_num_batched_tokens=8)
    e = llm.engine
    kv = e.kv_cache
    assert e.window_group.window == WINDOW and e.allocator.num_blocks == 40
    assert kv.windowed == [True, False, True, True]  # the checkpoint's layer types
    assert kv.window_blocks == min(41, window_pool_blocks(WINDOW, BS, 2, 8))
    assert e.window_group.allocator.num_blocks == kv.window_blocks - 1  # one is the null block
    assert [v.k.shape[0] for v in kv.views] == [kv.window_blocks, 40, kv.window_blocks, kv.window_blocks]
    assert [v.windowed for v in kv.views] == kv.windowed


def test_long_sequence_drops_window_blocks_and_matches_hf(mixed_ckpt):
    prompt = list(range(2000, 2030))
    chunk = 5  # cuts inside the window (6) and across blocks (4)
    llm = make(mixed_ckpt, num_kv_blocks=64, max_num_batched_tokens=chunk)
    peak_w = track_peak(llm.engine.window_group.allocator)
    peak_p = track_peak(llm.engine.allocator)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=40, logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    total = (len(prompt) + len(gen) + BS - 1) // BS
    assert peak_p[0] >= total - 1  # the full layers keep every block
    assert peak_w[0] <= window_blocks(WINDOW, chunk, BS) < total - 10
    ref = gemma_hf_logprobs(mixed_ckpt, prompt + gen)
    for i, tok in enumerate(gen):
        row = ref[len(prompt) + i - 1]
        assert tok == int(row.argmax()), f"greedy token {i} differs from HF"
        assert abs(out.outputs[0].logprobs[i][tok].logprob - row[tok].item()) <= 1e-4
    assert all_free(llm)


def test_prompt_logprobs_match_hf_with_chunks_inside_windows(mixed_ckpt):
    prompt = list(range(3000, 3041))
    ref = gemma_hf_logprobs(mixed_ckpt, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    llm = make(mixed_ckpt, num_kv_blocks=16, max_num_batched_tokens=5)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    assert (ours - ref).abs().max().item() <= 1e-4
    assert all_free(llm)


def test_prefix_cache_on_equals_off_and_hits(mixed_ckpt):
    prompts = [{"prompt_token_ids": list(range(4000, 4030)) + [7 + i, 9, 11]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    off = make(mixed_ckpt, num_kv_blocks=64, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    on = make(mixed_ckpt, num_kv_blocks=64, enable_prefix_caching=True, max_num_batched_tokens=8)
    outs = [on.generate(p, params, use_tqdm=False)[0] for p in prompts]  # one after the other: hits
    for a, b in zip(outs, off):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) <= 1e-4
    assert outs[1].num_cached_tokens >= 24 and outs[2].num_cached_tokens >= 24
    assert all_free(on)


def test_preemption_recomputes_the_same(mixed_ckpt):
    prompts = [{"prompt_token_ids": list(range(5000 + 100 * i, 5000 + 100 * i + 20 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    big = make(mixed_ckpt, num_kv_blocks=128).generate(prompts, params, use_tqdm=False)
    small = make(mixed_ckpt, num_kv_blocks=30, max_num_batched_tokens=8)  # room for about two sequences
    sched, preempted = small.engine.scheduler, []
    preempt = sched._preempt
    sched._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    outs = small.generate(prompts, params, use_tqdm=False)
    assert preempted
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in big]
    assert all_free(small)


def test_mixed_match_needs_the_window_blocks_of_the_prefix():
    prim, win = BlockAllocator(20), BlockAllocator(20, reserve_null=True)
    wg = WindowGroup(win, 6, BS)
    pc = PrefixCache(prim, BS, window_group=wg)
    tokens = list(range(100, 125))  # 25 tokens: 6 usable full blocks

    class Seq:
        token_ids, block_hashes, num_tokens, window_table = tokens, [], len(tokens), []

    hashes, parent = [], None
    for i in range(6):
        parent = chain_hash(parent, tokens[i * BS:(i + 1) * BS])
        hashes.append(parent)
    pb, wb = prim.allocate(6), win.allocate(6)
    for b, c, h in zip(pb, wb, hashes):
        prim.register(b, h)
        win.register(c, h)
    prim.free(pb)
    win.free(wb)
    win.forget(wb[:3])  # the window group's head evicted: a 6-block hit needs only its blocks 4 and 5
    seq = Seq()
    found, _ = pc.match(seq)
    assert found == pb and seq.window_table == [win.null_block] * 4 + wb[4:]
    assert prim.ref_counts[pb[0]] == 1 and win.ref_counts[wb[4]] == 1 and win.ref_counts[wb[3]] == 0
    prim.free(found)
    win.free(seq.window_table)
    win.forget(wb[5:])  # the last block's window part is gone: the hit stops one block earlier
    seq = Seq()
    found, _ = pc.match(seq)
    # A 5-block prefix (20 tokens) needs window keys from 20 - 6 + 1 = 15: blocks 3 and 4, both cached.
    assert found == pb[:5] and seq.window_table == [win.null_block] * 3 + wb[3:5]
    prim.free(found)
    win.free(seq.window_table)
    win.forget(wb[3:4])  # now no prefix has its window cached (a 3-block one would need block 2)
    seq = Seq()
    found, _ = pc.match(seq)
    assert found == [] and seq.window_table == []
    assert prim.num_free == prim.num_blocks and win.num_free == win.num_blocks


def test_padded_graph_body_equals_eager(mixed_ckpt, one_thread):
    """Every step through the CUDA-graph body on the CPU (its padded window-group slots and tables too)."""
    from test_cuda_graph_host import CheckedGraphs, _prompts

    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)] * 6
    kw = {"num_kv_blocks": 128, "max_num_batched_tokens": 24, "max_num_seqs": 6, "async_scheduling": True}
    want = make(mixed_ckpt, **kw).generate(_prompts(6, seed=2), params, use_tqdm=False)
    llm = make(mixed_ckpt, **kw)
    eng = llm.engine
    eng.runner.graphs = graphs = CheckedGraphs(eng.model, 6, eng.max_model_len, BS, eng.device,
                                               max_num_batched_tokens=24)
    assert graphs.inputs.window_slot_mapping is not None
    got = llm.generate(_prompts(6, seed=2), params, use_tqdm=False)
    assert graphs.worst < 1e-4, graphs.worst
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert {k.decode for _, k in graphs.used} == {True, False}
    assert all_free(llm)


class PartlyRightProposer:
    """Drafts the reference continuation with every third output position wrong, so verify steps accept 0, 1 or
    2 of their 3 drafts whatever the model generates (an n-gram proposer's hits depend on the random weights:
    gemma2 here repeats one token, every n-gram draft was right and nothing was ever trimmed)."""

    def __init__(self, prompts: list[dict], outputs: list[list[int]]) -> None:
        self.ref = {tuple(p["prompt_token_ids"]): out for p, out in zip(prompts, outputs)}

    def propose(self, seqs, k):
        drafts = []
        for s in seqs:
            start = s.num_output_tokens
            guess = self.ref[tuple(s.prompt_token_ids)][start:start + k]
            drafts.append([t if (start + j) % 3 != 2 else (t + 1) % 1000 + 100 for j, t in enumerate(guess)])
        return drafts


def test_rejected_drafts_trimmed_give_the_same_tokens(mixed_ckpt):
    from lamina.spec.config import parse_speculative_config
    from lamina.spec.decoder import SpecDecoder

    prompts = [{"prompt_token_ids": ([11, 12, 13, 14, 15] * 6)[: 22 + i] + [300 + i]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make(mixed_ckpt, num_kv_blocks=96).generate(prompts, params, use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in plain]
    llm = make(mixed_ckpt, num_kv_blocks=96, max_num_batched_tokens=16)
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "min_acceptance_rate": 0})
    llm.engine.spec = SpecDecoder(cfg, PartlyRightProposer(prompts, ref))
    trims, trim = [], llm.engine.scheduler.trim
    llm.engine.scheduler.trim = lambda seq: (trims.append(len(seq.window_table)), trim(seq))
    outs = llm.generate(prompts, params, use_tqdm=False)
    st = llm.engine.spec.stats
    assert trims and 0 < st.num_accepted_tokens < st.num_draft_tokens  # drafts verified, some rejected
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all_free(llm)


def test_memory_budget_goes_to_the_primary_pool(mixed_ckpt):
    budget = 0.002  # GiB
    llm = make(mixed_ckpt, kv_cache_memory_gb=budget, max_num_seqs=2, max_num_batched_tokens=8)
    kv = llm.engine.kv_cache
    specs = kv.specs
    prim = kv.bytes_per_block([s for s, w in zip(specs, kv.windowed) if not w], BS)
    win = kv.bytes_per_block([s for s, w in zip(specs, kv.windowed) if w], BS)
    shared = int(budget * 2**30) // (prim + win)  # what one shared table would have had
    assert kv.window_blocks == window_pool_blocks(WINDOW, BS, 2, 8) < shared
    assert kv.nbytes <= budget * 2**30 and kv.num_blocks > 3 * shared  # 3 of the 4 layers are sliding ones
    assert llm.engine.max_model_len >= min(kv.num_blocks * BS, llm.engine.model_config.max_position_embeddings)


def test_drop_dead_blocks_after_a_null_prefix():
    from lamina.cache.sliding_window import drop_dead_blocks

    a = BlockAllocator(20, reserve_null=True)
    null, blocks = a.null_block, a.allocate(8)
    a.free(blocks[:3])
    table = [null] * 3 + blocks[3:]  # what an earlier drop (or a windowed prefix hit) leaves
    # A query at 26 reads keys from 26 - 6 + 1 = 21: blocks 0..4 are dead, of which 3 and 4 are still held.
    new, n = drop_dead_blocks(table, 26, a, BS, 6)
    assert n == 2 and new == [null] * 5 + blocks[5:] and a.num_free == 19 - 3
    again, m = drop_dead_blocks(new, 26, a, BS, 6)
    assert m == 0 and again is new


def test_window_pool_never_exceeds_its_sizing_bound(mixed_ckpt):
    # Many sequences on a small budget: some are left out of steps with their last chunk's blocks, which the
    # per-step drop over every running sequence returns before the bound (window_pool_blocks) can be crossed.
    prompts = [{"prompt_token_ids": list(range(6000 + 50 * i, 6000 + 50 * i + 17 + 5 * i))} for i in range(5)]
    llm = make(mixed_ckpt, num_kv_blocks=200, max_num_batched_tokens=8, max_num_seqs=4)
    peak = track_peak(llm.engine.window_group.allocator)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert peak[0] <= window_pool_blocks(WINDOW, BS, 4, 8) - 1  # the null block is not leasable
    assert all_free(llm)
