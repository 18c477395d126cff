"""Sampled requests under speculation: seeded outputs identical to plain decoding (drafts all right, all wrong,
and n-gram), penalties / min_tokens / stop ids / logprobs as without speculation, and a two-sample chi-square
test that unseeded sampling with drafts draws from the same distribution (with a control showing the test
detects a slightly different distribution)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
from spec_helpers import OracleProposer, all_free, make, outputs, spec_prompts, with_proposer

from lamina import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def seeded(i: int, **kw) -> SamplingParams:
    base = dict(temperature=0.9, top_p=0.95, top_k=40, max_tokens=40, ignore_eos=True, seed=1000 + i)
    return SamplingParams(**{**base, **kw})


@pytest.fixture(scope="module")
def plain_seeded(checkpoints, one_thread):
    ps = spec_prompts(6, seed=3)
    params = [seeded(i) for i in range(len(ps))]
    llm = make(checkpoints["llama"])
    return ps, params, [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


@pytest.mark.parametrize("how", ["all right", "all wrong", "ngram", "self_spec"])
def test_seeded_sampling_identical(checkpoints, plain_seeded, how):
    ps, params, ref = plain_seeded
    if how == "ngram":
        llm = make(checkpoints["llama"], speculative_config=NGRAM)
    elif how == "self_spec":
        llm = make(checkpoints["llama"], speculative_config={"method": "self_spec", "num_speculative_tokens": 2,
                                                             "skip_layers": [1]})
    else:
        llm = with_proposer(make(checkpoints["llama"]), OracleProposer(ps, ref, how == "all wrong"), 3)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert got == ref
    st = llm.engine.stats()
    if how == "all right":
        assert st.num_spec_accepted_tokens == st.num_spec_draft_tokens > 0
    elif how == "all wrong":
        assert st.num_spec_accepted_tokens == 0 < st.num_spec_draft_tokens
    assert all_free(llm)


def test_penalties_min_tokens_stop_and_logprobs_as_without(checkpoints, one_thread):
    """Penalties read the accepted drafts as history, min_tokens bans by output index, a stop id ends the run
    where it lands, and the logprobs are the target model's for each emitted token."""
    ps = spec_prompts(4, seed=5)
    plain = make(checkpoints["llama"])
    kinds = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.4, logprobs=2),
             seeded(0, frequency_penalty=0.7, presence_penalty=0.3, logprobs=1),
             seeded(1, min_tokens=12, max_tokens=30)]
    for params in kinds:
        ref = plain.generate(ps, params, use_tqdm=False)
        stop = [ref[0].outputs[0].token_ids[15]]
        params.stop_token_ids = stop  # the 16th token of the first prompt (or earlier) ends it
        if params.min_tokens:
            params.stop_token_ids = [ref[0].outputs[0].token_ids[5]]  # banned below 12 tokens
        ref = plain.generate(ps, params, use_tqdm=False)
        ref_ids = [o.outputs[0].token_ids for o in ref]
        for spec in ("right", "ngram"):
            if spec == "ngram":
                llm = make(checkpoints["llama"], speculative_config=NGRAM)
            else:
                llm = with_proposer(make(checkpoints["llama"]), OracleProposer(ps, ref_ids), 4)
            got = llm.generate(ps, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in got] == ref_ids
            assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in ref]
            if params.logprobs is not None:
                for a, b in zip(got, ref):
                    assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs)
                    for tok, pa, pb in zip(a.outputs[0].token_ids, a.outputs[0].logprobs,
                                           b.outputs[0].logprobs):
                        # the emitted token's logprob and rank; the top values (exact ties may swap ids)
                        assert math.isclose(pa[tok].logprob, pb[tok].logprob, abs_tol=1e-4)
                        assert pa[tok].rank == pb[tok].rank
                        va = sorted(v.logprob for v in pa.values())
                        vb = sorted(v.logprob for v in pb.values())
                        assert len(va) == len(vb) and all(math.isclose(x, y, abs_tol=1e-4)
                                                          for x, y in zip(va, vb))
            assert all_free(llm)


def _chi2(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the cells seen (and its degrees of freedom)."""
    na, nb = sum(a.values()), sum(b.values())
    stat, cells = 0.0, 0
    for key in set(a) | set(b):
        x, y = a.get(key, 0), b.get(key, 0)
        stat += (math.sqrt(nb / na) * x - math.sqrt(na / nb) * y) ** 2 / (x + y)
        cells += 1
    return stat, cells - 1


def test_unseeded_distribution_matches(checkpoints, one_thread):
    """1200 unseeded samples of a 3-token continuation (top_k=3: 27 outcomes) with drafts (the most likely
    continuation: accepted often, rejected often) against 1200 without: the chi-square statistic stays
    below the 0.1% quantile. A control shows the test can fail."""
    prompt = spec_prompts(1, seed=9)[0]
    n = 1200
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    greedy = outputs(make(checkpoints["llama"]), [prompt], SamplingParams(temperature=0, max_tokens=3,
                                                                          ignore_eos=True))[0]
    cfg = dict(max_num_seqs=256, max_num_batched_tokens=1024, seed=1)
    plain = Counter(map(tuple, outputs(make(checkpoints["llama"], **cfg), [prompt] * n, params)))
    spec_llm = with_proposer(make(checkpoints["llama"], **{**cfg, "seed": 2}),
                             OracleProposer([prompt], [greedy]), 2)
    spec = Counter(map(tuple, outputs(spec_llm, [prompt] * n, params)))
    st = spec_llm.engine.stats()
    assert 0 < st.num_spec_accepted_tokens < st.num_spec_draft_tokens  # both outcomes happen often
    stat, df = _chi2(plain, spec)
    limit = df + 3.09 * math.sqrt(2 * df) + 3  # ~ the 0.1% upper quantile (Wilson-Hilferty, generous)
    assert stat < limit, (stat, df, plain.most_common(5), spec.most_common(5))
    # The control: an independent plain run passes, and fails once every 10th sample is replaced by the
    # drafts (what an acceptance rule biased towards its drafts by that much would produce).
    again = outputs(make(checkpoints["llama"], **{**cfg, "seed": 3}), [prompt] * n, params)
    assert _chi2(plain, Counter(map(tuple, again)))[0] < limit
    biased = Counter(tuple(greedy) if i % 10 == 0 else tuple(o) for i, o in enumerate(again))
    stat_c, df_c = _chi2(plain, biased)
    assert stat_c > df_c + 3.09 * math.sqrt(2 * df_c) + 3, (stat_c, df_c)
    assert all_free(spec_llm)
