"""Forced acceptance (bench only): the replay proposer decides each verify step's accepted count, so a verify
step does a real verify step's work at acceptance p whatever the numerics. p = 1 accepts K per step, p = 0
none, p = 0.8 a mean near p + p^2 + p^3; every block and state slot is free afterwards; LLM(...) and
`lamina serve` refuse it like every bench-only method."""
from __future__ import annotations

import json

import pytest
from hybrid_helpers import make_hybrid_checkpoint
from spec_helpers import all_free, make, spec_prompts

from lamina import SamplingParams
from lamina.spec.config import parse_speculative_config

K = 3


def forced(p: float, **extra):
    return parse_speculative_config({"method": "replay", "num_speculative_tokens": K, "acceptance_prob": p,
                                     "forced": True, "min_acceptance_rate": 0, **extra}, bench=True)


def _run(llm, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    res = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(r.outputs[0].token_ids) == max_tokens for r in res)
    return llm.engine.stats()


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory, smol_tokenizer, one_thread):
    return make_hybrid_checkpoint(tmp_path_factory.mktemp("forced_hybrid") / "qwen3_next", "qwen3_next",
                                  smol_tokenizer, seed=12)


def _slots_free(llm) -> bool:
    pool = llm.engine.state_pool
    return pool is None or pool.num_free == pool.num_slots


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_forced_all_and_none(checkpoints, hybrid_path, kind, one_thread):
    path = checkpoints["llama"] if kind == "dense" else hybrid_path
    ps = spec_prompts(4, seed=5)
    # 65 tokens: the prefill's one, then 16 verify steps of K + 1 (none capped by max_tokens)
    llm = make(path, speculative_config=forced(1.0))
    st = _run(llm, ps, 65)
    assert st.num_spec_drafts == 16 * len(ps)
    assert st.spec_accepted_per_position == [16 * len(ps)] * K
    assert st.num_spec_accepted_tokens == st.num_spec_draft_tokens == K * st.num_spec_drafts
    assert all_free(llm) and _slots_free(llm)
    llm = make(path, speculative_config=forced(0.0))
    st = _run(llm, ps, 24)
    # one verify step per token after the prefill's, but the last: the final two capped by max_tokens (2, 1)
    assert st.num_spec_drafts == 22 * len(ps) and st.num_spec_draft_tokens == (20 * K + 3) * len(ps)
    assert st.num_spec_accepted_tokens == 0
    assert all_free(llm) and _slots_free(llm)


def test_forced_mean_accepted_length(checkpoints, one_thread):
    p = 0.8
    llm = make(checkpoints["llama"], speculative_config=forced(p), max_num_seqs=8)
    st = _run(llm, spec_prompts(8, seed=6), 80)
    per_verify = st.num_spec_accepted_tokens / st.num_spec_drafts
    assert st.num_spec_drafts > 150
    assert per_verify == pytest.approx(p + p**2 + p**3, abs=0.25)
    by_pos = [a / st.num_spec_drafts for a in st.spec_accepted_per_position]
    assert by_pos[0] == pytest.approx(p, abs=0.1) and by_pos[0] >= by_pos[1] >= by_pos[2]
    assert all_free(llm)


def test_forced_follows_drafts_not_target(checkpoints, one_thread):
    """The output is the drafts (right per the proposer) plus the target's token after the last accepted one:
    with no reference, forced p = 1 emits the proposer's filler tokens (last token + 1, + 2, ...)."""
    llm = make(checkpoints["llama"], speculative_config=forced(1.0))
    res = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=9,
                                                                        ignore_eos=True), use_tqdm=False)
    out = res[0].outputs[0].token_ids
    assert out[1:4] == [out[0] + 1, out[0] + 2, out[0] + 3]
    assert all_free(llm)


def test_forced_is_bench_only(capsys):
    from lamina.args import CliParser, add_engine_args
    from lamina.llm import LLM

    cfg = {"method": "replay", "num_speculative_tokens": 2, "forced": True}
    with pytest.raises(ValueError, match="bench-only"):
        LLM(model="random:tiny-llama", device="cpu", speculative_config=cfg)
    p = CliParser(prog="lamina serve")
    add_engine_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", json.dumps(cfg)])
    assert "bench-only" in capsys.readouterr().err
    with pytest.raises(ValueError, match="forced"):
        parse_speculative_config({**cfg, "forced": "yes"}, bench=True)
    with pytest.raises(ValueError, match="takes no option"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "forced": True})
    assert parse_speculative_config(cfg, bench=True).to_dict()["forced"] is True


@pytest.mark.parametrize("where", [1, 2, 3])
def test_stop_id_inside_an_accepted_run(checkpoints, where, one_thread):
    """A stop id at draft j of an accepted run ends the sequence there (the readback's one-slice path must
    hand such a run to the per-token stop checks), and its tokens after the stop are dropped."""
    llm = make(checkpoints["llama"], speculative_config=forced(1.0))
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    ref = free[0].outputs[0].token_ids
    stop = ref[where]
    if stop in ref[:where]:
        pytest.skip("the stop id occurs earlier in the run")
    res = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                                              stop_token_ids=[stop]), use_tqdm=False)
    out = res[0].outputs[0]
    assert out.token_ids == ref[:where + 1] and out.finish_reason == "stop"
    # max_tokens: the drafts are capped to fit (which changes what forced acceptance emits), the length holds
    res = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=where + 1, ignore_eos=True), use_tqdm=False)
    assert len(res[0].outputs[0].token_ids) == where + 1 and res[0].outputs[0].finish_reason == "length"
    assert all_free(llm)
