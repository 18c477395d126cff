"""Speculative decoding on hybrid models (Gated DeltaNet + attention): the verify step keeps the recurrent
and conv state after every draft position in leased candidate slots, and the state at the last accepted
token is committed. Greedy outputs identical to plain decoding (ngram and forced drafts: all right, all
wrong), with chunked prefill, preemption and prefix caching (snapshots only at accepted positions); every
block and state slot free afterwards. The verify reference against the plain recurrent rule, per token."""
from __future__ import annotations

import pytest
import torch
from hybrid_helpers import make_hybrid_checkpoint
from spec_helpers import GREEDY64, OracleProposer, make, outputs, spec_prompts, with_proposer

from lamina.kernels.gated_delta import recurrent_gated_delta_rule_ref, recurrent_verify_ref

# Gates off: on these prompts the lookup finds a draft only late in the output (a run of empty proposals
# would pause the sequences first, spec/adaptive.py), and these tests need verify steps.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "min_acceptance_rate": 0}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, smol_tokenizer, one_thread):
    path = make_hybrid_checkpoint(tmp_path_factory.mktemp("spec_hybrid") / "qwen3_next", "qwen3_next",
                                  smol_tokenizer, seed=10)
    ps = spec_prompts(4, seed=21)
    return path, ps, outputs(make(path), ps, GREEDY64)


def all_free(llm) -> bool:
    eng = llm.engine
    return (eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running and not eng.groups
            and eng.state_pool.num_free == eng.state_pool.num_slots)


SCENARIOS = {"plain": {}, "chunked": {"max_num_batched_tokens": 12}, "preemption": {"num_kv_blocks": 40},
             "snapshots": {"state_snapshot_interval": 8}, "no prefix caching": {"enable_prefix_caching": False}}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_hybrid_ngram_identical(hybrid, scenario):
    path, ps, ref = hybrid
    llm = make(path, speculative_config=NGRAM, **SCENARIOS[scenario])
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    assert st.num_spec_draft_tokens > 0
    assert all_free(llm)


@pytest.mark.parametrize("wrong", [False, True], ids=["all right", "all wrong"])
def test_hybrid_forced_drafts(hybrid, wrong):
    path, ps, ref = hybrid
    llm = with_proposer(make(path, state_snapshot_interval=8), OracleProposer(ps, ref, wrong), 4)
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    assert st.num_spec_draft_tokens > 0
    assert st.num_spec_accepted_tokens == (0 if wrong else st.num_spec_draft_tokens)
    assert all_free(llm)
    # a second pass over the same prompts is served from prefix-cache snapshots taken at accepted positions
    assert outputs(llm, ps, GREEDY64) == ref
    assert llm.engine.stats().num_snapshot_hits > 0
    assert all_free(llm)


def test_hybrid_draft_model(hybrid, checkpoints):
    path, ps, ref = hybrid
    llm = make(path, speculative_config={"method": "draft_model", "model": str(checkpoints["qwen2"]),
                                         "num_speculative_tokens": 3})
    assert outputs(llm, ps, GREEDY64) == ref
    assert all_free(llm)


def test_recurrent_verify_ref_keeps_every_state():
    torch.manual_seed(0)
    length, hk, hv, dk, dv = 4, 2, 4, 8, 6
    q, k = torch.randn(length, hk, dk), torch.randn(length, hk, dk)
    v = torch.randn(length, hv, dv)
    g, beta = -torch.rand(length, hv), torch.rand(length, hv)
    init = torch.randn(1, hv, dk, dv)
    pool = torch.full((8, hv, dk, dv), float("nan"))
    out = recurrent_verify_ref(q, k, v, g, beta, init, pool, [5, 2, 7], 0)
    ref_out, _ = recurrent_gated_delta_rule_ref(q[None], k[None], v[None], g[None], beta[None], init)
    torch.testing.assert_close(out, ref_out[0])
    for j, slot in enumerate([5, 2, 7, 0]):
        _, state = recurrent_gated_delta_rule_ref(q[None, :j + 1], k[None, :j + 1], v[None, :j + 1],
                                                  g[None, :j + 1], beta[None, :j + 1], init)
        torch.testing.assert_close(pool[slot], state[0])
