"""Greedy speculative decoding is lossless: outputs over 64 tokens identical to plain decoding, with mixed
batches, chunked prefill, preemption and prefix caching, for the n-gram proposer and for drafts forced all
right and all wrong; every block is back in the pool afterwards, and rejected drafts' blocks are freed."""
from __future__ import annotations

import pytest
from spec_helpers import GREEDY64, OracleProposer, all_free, make, outputs, spec_prompts, with_proposer

from lamina import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def plain(checkpoints, one_thread):
    ps = spec_prompts(6)
    return ps, outputs(make(checkpoints["llama"]), ps, GREEDY64)


SCENARIOS = {
    "mixed batch": {},
    "chunked prefill": {"max_num_batched_tokens": 12},
    "preemption": {"num_kv_blocks": 40},
    "no prefix caching": {"enable_prefix_caching": False},
    "overlap": {"async_scheduling": True},
}


SELF_SPEC = {"method": "self_spec", "num_speculative_tokens": 3, "skip_layers": [1]}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", ["ngram", "self_spec"])
def test_greedy_identical(checkpoints, plain, scenario, method):
    ps, ref = plain
    cfg = NGRAM if method == "ngram" else SELF_SPEC
    llm = make(checkpoints["llama"], speculative_config=cfg, **SCENARIOS[scenario])
    assert outputs(llm, ps, GREEDY64) == ref
    stats = llm.engine.stats()
    assert stats.num_spec_drafts > 0 and stats.num_spec_draft_tokens >= stats.num_spec_drafts
    assert 0 <= stats.num_spec_accepted_tokens <= stats.num_spec_draft_tokens
    assert sum(stats.spec_accepted_per_position) == stats.num_spec_accepted_tokens
    assert all_free(llm)


@pytest.mark.parametrize("method", ["ngram", "self_spec"])
def test_preemption_really_happens_with_drafts(checkpoints, plain, method):
    ps, ref = plain
    llm = make(checkpoints["llama"], speculative_config=NGRAM if method == "ngram" else SELF_SPEC,
               num_kv_blocks=40)
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, GREEDY64)
    seqs = [eng.groups[str(i)].seqs[0] for i in range(len(ps))]
    while eng.has_unfinished_requests():
        eng.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    assert [s.output_token_ids for s in seqs] == ref
    assert all_free(llm)


@pytest.mark.parametrize("wrong", [False, True], ids=["all right", "all wrong"])
@pytest.mark.parametrize("k", [1, 4])
def test_forced_drafts(checkpoints, plain, wrong, k):
    ps, ref = plain
    llm = with_proposer(make(checkpoints["llama"], max_num_batched_tokens=24), OracleProposer(ps, ref, wrong), k)
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    assert st.num_spec_draft_tokens > 0
    if wrong:
        assert st.num_spec_accepted_tokens == 0
    else:
        assert st.num_spec_accepted_tokens == st.num_spec_draft_tokens
        assert st.spec_accepted_per_position[0] == st.num_spec_drafts  # (the budget caps some runs)
        # all right with k drafts: 64 tokens in about 64 / (k + 1) verify steps per sequence
        assert st.num_spec_drafts <= len(ps) * (64 // (k + 1) + 3)
    assert all_free(llm)


def test_rejected_blocks_are_freed_and_budget_counts_drafts(checkpoints, plain):
    """All drafts rejected: after each verify step a sequence holds exactly the blocks of its computed
    positions (the ones grown for the drafts went back); the step's token count includes the drafts."""
    ps, ref = plain
    k = 7
    llm = with_proposer(make(checkpoints["llama"], max_num_batched_tokens=64), OracleProposer(ps, ref, True), k)
    eng = llm.engine
    eng.add_request("a", ps[0], GREEDY64)
    seq = eng.groups["a"].seqs[0]
    eng.step()  # prompt
    checked = 0
    while eng.has_unfinished_requests():
        eng.spec.propose(eng.scheduler.running)
        sched = eng.scheduler.schedule()
        drafts = list(seq.draft_token_ids)  # as the scheduler capped them (max_tokens near the end)
        item, = sched.scheduled
        assert item.num_tokens == 1 + len(drafts) and item.num_sampled == 1 + len(drafts)
        assert len(drafts) == min(k, 64 - seq.num_output_tokens - 1)
        assert len(seq.block_table) * 4 >= seq.num_computed_tokens + item.num_tokens
        assert eng.in_flight is None  # no overlap: the step is launched and read back here
        eng._resolve(eng._launch(sched.scheduled), {})
        if seq.finished:
            break
        assert len(seq.block_table) == (seq.num_computed_tokens + 3) // 4
        checked += bool(drafts)
    assert checked > 5 and seq.output_token_ids == ref[0]
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running


def test_self_spec_without_skipped_layers_drafts_what_the_target_says(checkpoints, plain):
    """Skipping no layer (the default on a 2-layer model) makes the drafter the target itself: every greedy
    draft stands, 64 tokens come in about 64 / 4 steps per sequence."""
    ps, ref = plain
    llm = make(checkpoints["llama"], speculative_config={"method": "self_spec", "num_speculative_tokens": 3})
    assert llm.engine.spec.proposer.keep == [0, 1]
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    assert st.num_spec_accepted_tokens == st.num_spec_draft_tokens > 0
    assert all_free(llm)


def test_self_spec_refuses_bad_layers(checkpoints):
    for skip, words in (([5], "out of range"), ([0, 1], "leaves no layer")):
        with pytest.raises(ValueError, match=words):
            make(checkpoints["llama"], speculative_config={"method": "self_spec", "num_speculative_tokens": 2,
                                                           "skip_layers": skip})


def test_budget_caps_drafts(checkpoints, plain):
    ps, ref = plain
    llm = with_proposer(make(checkpoints["llama"], max_num_batched_tokens=3), OracleProposer(ps, ref), 5)
    eng = llm.engine
    eng.add_request("a", ps[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    while eng.groups["a"].seqs[0].num_output_tokens == 0:
        eng.step()
    eng.spec.propose(eng.scheduler.running)
    item, = eng.scheduler.schedule().scheduled
    assert item.num_tokens == 3 and item.num_sampled == 3  # 1 + 2 drafts: the budget, not K = 5


def test_stop_inside_an_accepted_run(checkpoints, plain):
    """A stop token id and max_tokens landing inside a run of accepted drafts end the sequence right there."""
    ps, ref = plain
    stop_at = ref[1][9]
    first = ref[1].index(stop_at)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, stop_token_ids=[stop_at])
    llm = with_proposer(make(checkpoints["llama"]), OracleProposer(ps, ref), 4)
    out, = llm.generate([ps[1]], params, use_tqdm=False)
    assert out.outputs[0].token_ids == ref[1][:first + 1] and out.outputs[0].finish_reason == "stop"
    out, = llm.generate([ps[1]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == ref[1][:7]
    assert all_free(llm)


def test_abort_mid_run_returns_leases(checkpoints, plain):
    ps, ref = plain
    llm = with_proposer(make(checkpoints["llama"]), OracleProposer(ps, ref), 3)
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, GREEDY64)
    for _ in range(6):
        eng.step()
    for rid in list(eng.groups):
        eng.abort_request(rid)
    assert all_free(llm)
