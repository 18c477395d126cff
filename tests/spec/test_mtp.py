"""mtp: the checkpoint's multi-token-prediction head drafts from the target's hidden states.

Oracle: a plain torch re-implementation of the head from its definition (tests/spec/mtp_helpers.py: HF's own
decoder layer over the whole sequence, no cache, on the HF target's hidden states): every proposal's draft
logits match it, also after partly accepted runs (the hidden-state rows the head keeps follow the target's
rollback) and on prefix-cache hits (the head's KV lives in the target's blocks, so a hit serves it too).
Greedy outputs equal plain decoding over 64 tokens with mixed batches, chunked prefill, preemption, prefix
caching (with snapshot hits on a second pass) and without; seeded sampling gives the plain run's tokens;
every block and state slot goes back. For Qwen3-Next (MoE layer), Qwen3.5 (dense layer, multimodal
checkpoint) and Qwen3.5-MoE.
"""
from __future__ import annotations

import pytest
import torch
from mtp_helpers import MTPOracle, make_mtp_checkpoint
from spec_helpers import GREEDY64, make, outputs, spec_prompts

from lamina import SamplingParams

MTP3 = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def mtp_model(request, tmp_path_factory, smol_tokenizer, one_thread):
    family = request.param
    path = make_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / family, family, smol_tokenizer, seed=30)
    ps = spec_prompts(4, seed=31)
    return family, path, ps, outputs(make(path), ps, GREEDY64)


def all_free(llm) -> bool:
    eng = llm.engine
    prop = eng.spec.proposer  # its records went after the step that finished each sequence
    return (eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running and not eng.groups
            and eng.state_pool.num_free == eng.state_pool.num_slots and not prop.seqs)


class Recorder:
    """Wraps the MTP proposer: records (known tokens, drafts, draft logits) of every proposal, and with `ref`
    replaces the drafts by the reference continuation's first a tokens plus wrong ones (a cycling 0..k), so
    runs are accepted partly while the head keeps drafting (and its state keeps following the target)."""

    def __init__(self, prop, ref: dict | None = None) -> None:
        self.prop, self.ref, self.records, self.calls = prop, ref, [], 0
        self.inner = prop.propose
        prop.keep_logits = True
        prop.propose = self.propose

    def propose(self, seqs, k):
        drafts = self.inner(seqs, k)
        for s, d in zip(seqs, drafts):
            if d:
                self.records.append((list(s.token_ids), list(d), self.prop.last_logits[s.seq_id].clone()))
        if self.ref is None:
            return drafts
        out = []
        for s, d in zip(seqs, drafts):
            self.calls += 1
            a = self.calls % (len(d) + 1) if d else 0
            want = self.ref[tuple(s.prompt_token_ids)][s.num_output_tokens:s.num_output_tokens + len(d)]
            out.append(list(want[:a]) + [(t + 1) % 1000 + 100 for t in want[a:]])
        return out


@pytest.mark.parametrize("forced", [False, True], ids=["own drafts", "partly accepted"])
def test_mtp_draft_logits_match_oracle(mtp_model, forced):
    family, path, ps, ref = mtp_model
    # gates off: this counts the head's proposals (the batch-wide gate would turn a random head's drafts off)
    llm = make(path, speculative_config={**MTP3, "min_acceptance_rate": 0}, state_snapshot_interval=4)
    short = ps[:3]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    table = {tuple(p["prompt_token_ids"]): r for p, r in zip(ps, ref)} if forced else None
    rec = Recorder(llm.engine.spec.proposer, table)
    for _ in range(2):  # the second pass hits the prefix cache (snapshots), the head's KV included
        assert outputs(llm, short, params) == [r[:10] for r in ref[:3]]
    st = llm.engine.stats()
    assert st.num_snapshot_hits > 0
    if forced:
        assert 0 < st.num_spec_accepted_tokens < st.num_spec_draft_tokens
    oracle = MTPOracle(path)
    assert len(rec.records) >= 12
    for tokens, drafts, logits in rec.records:
        want, want_logits = oracle.drafts(tokens, len(drafts))
        torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4)
        assert drafts == want
    assert all_free(llm)


SCENARIOS = {"plain": {}, "chunked": {"max_num_batched_tokens": 12}, "preemption": {"num_kv_blocks": 40},
             "snapshots": {"state_snapshot_interval": 8}, "no prefix caching": {"enable_prefix_caching": False}}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_mtp_greedy_identical(mtp_model, scenario):
    family, path, ps, ref = mtp_model
    if family != "qwen3_next" and scenario in ("chunked", "no prefix caching"):
        pytest.skip("the shared paths are covered on qwen3_next; qwen3_5 runs the rest")
    llm = make(path, speculative_config=MTP3, **SCENARIOS[scenario])
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    assert st.num_spec_draft_tokens > 0
    if scenario == "preemption":
        assert st.num_preemptions > 0
    assert all_free(llm)
    if scenario == "snapshots":  # the same prompts again: served from snapshots, the head from fewer positions
        assert outputs(llm, ps, GREEDY64) == ref
        assert llm.engine.stats().num_snapshot_hits > 0
        assert all_free(llm)


def test_mtp_fp8_kv_cache(mtp_model):
    """--kv-cache-dtype fp8: the head's own pool is FP8 too; the target's outputs stay those of plain decoding
    with the same cache dtype."""
    family, path, ps, _ = mtp_model
    if family != "qwen3_next":
        pytest.skip("one family is enough")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = outputs(make(path, kv_cache_dtype="fp8"), ps, params)
    llm = make(path, kv_cache_dtype="fp8", speculative_config=MTP3)
    assert llm.engine.spec.proposer.head.layers[0].self_attn.k_cache.dtype == torch.float8_e4m3fn
    assert outputs(llm, ps, params) == ref
    assert llm.engine.stats().num_spec_draft_tokens > 0
    assert all_free(llm)


def test_mtp_partly_accepted_identical_with_preemption(mtp_model):
    family, path, ps, ref = mtp_model
    llm = make(path, speculative_config=MTP3, num_kv_blocks=40, max_num_batched_tokens=16)
    Recorder(llm.engine.spec.proposer, {tuple(p["prompt_token_ids"]): r for p, r in zip(ps, ref)})
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    assert 0 < st.num_spec_accepted_tokens < st.num_spec_draft_tokens
    assert all_free(llm)


def test_mtp_abort_and_stop_mid_run(mtp_model):
    """An abort and a stop string's finish in the middle of drafting: the others' outputs are unchanged, and
    every lease (the head's blocks included) is back after the next step."""
    family, path, ps, ref = mtp_model
    llm = make(path, speculative_config=MTP3)
    Recorder(llm.engine.spec.proposer, {tuple(p["prompt_token_ids"]): r for p, r in zip(ps, ref)})
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, GREEDY64)
    for _ in range(5):
        eng.step()
    assert eng.spec.proposer.seqs
    eng.abort_request("0")
    eng.finish_sample("1", 0, 3, "stop")
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {str(i): ref[i] for i in range(2, len(ps))}
    assert all_free(llm)


def test_mtp_seeded_sampling_reproducible(mtp_model):
    family, path, ps, _ = mtp_model
    params = [SamplingParams(temperature=0.9, top_k=50, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(ps))]
    plain = [o.outputs[0].token_ids for o in make(path).generate(ps, params, use_tqdm=False)]
    llm = make(path, speculative_config=MTP3)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        assert got == plain
    assert llm.engine.stats().num_spec_draft_tokens > 0
    assert all_free(llm)


def test_mtp_refuses_more_than_one_layer(tmp_path):
    from lamina.spec.mtp_head import check_mtp_names

    assert check_mtp_names(["mtp.fc.weight", "mtp.layers.0.mlp.experts.0.up_proj.weight"]) == "moe"
    assert check_mtp_names(["mtp.fc.weight", "mtp.layers.0.mlp.up_proj.weight"]) == "dense"
    with pytest.raises(ValueError, match="one MTP layer") as e:
        check_mtp_names(["mtp.layers.0.mlp.up_proj.weight", "mtp.layers.1.mlp.up_proj.weight"])
    assert "\n" not in str(e.value)


def test_mtp_qwen3_5_moe(tmp_path_factory, smol_tokenizer, one_thread):
    """Qwen3.5-MoE: the head's MoE layer with its shared expert folded into the routed ones, as the model's."""
    path = make_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "qwen3_5_moe", "qwen3_5_moe", smol_tokenizer,
                               seed=32)
    ps = spec_prompts(3, seed=33)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = outputs(make(path), ps, params)
    llm = make(path, speculative_config=MTP3)
    rec = Recorder(llm.engine.spec.proposer, {tuple(p["prompt_token_ids"]): r for p, r in zip(ps, ref)})
    assert outputs(llm, ps, params) == ref
    oracle = MTPOracle(path)
    assert len(rec.records) >= 6
    for tokens, drafts, logits in rec.records:
        want, want_logits = oracle.drafts(tokens, len(drafts))
        torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4)
        assert drafts == want
    assert all_free(llm)
