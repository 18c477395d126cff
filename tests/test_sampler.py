"""Sampler semantics on crafted logits, with HF transformers' logits processors as the oracle where they exist."""
from __future__ import annotations

import collections

import pytest
import torch

from lamina.engine.detokenizer import initial_state
from lamina.engine.request import Sequence
from lamina.engine.sampler import Sampler
from lamina.sampling_params import SamplingParams


def seq(params: SamplingParams, tokens=(1, 2, 3), prompt_len=2, seed=None) -> Sequence:
    return Sequence(0, "r", 0, list(tokens), prompt_len, params, seed if seed is not None else params.seed,
                    params.max_tokens or 16, initial_state(prompt_len))


LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])


def draw(params: SamplingParams, n: int = 400, logits=LOGITS) -> collections.Counter:
    sampler = Sampler([], seed=0)
    return collections.Counter(sampler(logits.repeat(n, 1), [seq(params)] * n).token_ids)


def test_greedy_is_argmax():
    assert set(draw(SamplingParams(temperature=0), 8)) == {0}


def test_top_k_top_p_min_p_restrict_support():
    assert set(draw(SamplingParams(temperature=1.0, top_k=2))) == {0, 1}
    # softmax of LOGITS: p0=.636, p1=.234, p2=.086: top_p .8 keeps {0, 1}; .6 keeps {0}.
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.8))) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.6))) == {0}
    # min_p .3: keep tokens with p >= .3 * .636 = .19 -> {0, 1}.
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.3))) == {0, 1}


def test_temperature_sampling_follows_the_distribution():
    counts = draw(SamplingParams(temperature=2.0), n=20000)
    probs = (LOGITS[0] / 2.0).softmax(-1)
    for tok, p in enumerate(probs.tolist()):
        assert abs(counts[tok] / 20000 - p) < 0.015


def test_seeded_rows_do_not_depend_on_batch():
    sampler = Sampler([], seed=0)
    p = SamplingParams(temperature=1.0, seed=42)
    logits = torch.randn(1, 1000)
    alone = [sampler(logits, [seq(p, tokens=(1, 2) + (5,) * k)]).token_ids[0] for k in range(10)]
    noise = SamplingParams(temperature=1.0)
    batched = []
    for k in range(10):
        rows = torch.cat([torch.randn(3, 1000), logits])
        batched.append(sampler(rows, [seq(noise)] * 3 + [seq(p, tokens=(1, 2) + (5,) * k)]).token_ids[3])
    assert alone == batched and len(set(alone)) > 1


def test_repetition_penalty_matches_hf():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 50)
    tokens = (3, 7, 7, 20)
    p = SamplingParams(temperature=0, repetition_penalty=1.7, logprobs=0)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([tokens]), logits.clone())
    sampler = Sampler([])
    out = sampler(logits, [seq(p, tokens=tokens)])
    assert out.token_ids[0] == int(ref.argmax())
    # Force a case where the penalty flips the argmax.
    logits = torch.zeros(1, 10)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    assert sampler(logits, [seq(p, tokens=(3, 3))]).token_ids[0] == 4


def test_presence_and_frequency_penalties_use_output_counts():
    logits = torch.zeros(1, 10)
    logits[0, 5] = 1.0
    sampler = Sampler([])
    # Token 5 appears 3 times in the output: 1 - 3 * 0.5 < 0, so another token wins; in the prompt it is free.
    p = SamplingParams(temperature=0, frequency_penalty=0.5)
    assert sampler(logits, [seq(p, tokens=(1, 5, 5, 5), prompt_len=1)]).token_ids[0] != 5
    assert sampler(logits, [seq(p, tokens=(5, 5, 5, 1), prompt_len=3)]).token_ids[0] == 5
    p = SamplingParams(temperature=0, presence_penalty=1.5)
    assert sampler(logits, [seq(p, tokens=(1, 5), prompt_len=1)]).token_ids[0] != 5


def test_min_tokens_bans_eos():
    logits = torch.zeros(1, 10)
    logits[0, 2] = 5.0
    sampler = Sampler([2])
    assert sampler(logits, [seq(SamplingParams(temperature=0, min_tokens=3))]).token_ids[0] != 2
    assert sampler(logits, [seq(SamplingParams(temperature=0))]).token_ids[0] == 2


def test_logprobs_are_raw_model_logprobs_with_ranks():
    sampler = Sampler([])
    out = sampler(LOGITS, [seq(SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5))])
    ref = LOGITS.log_softmax(-1)[0]
    assert out.top_ids[0] == [0, 1, 2]
    assert out.chosen_logprobs[0] == pytest.approx(ref[out.token_ids[0]].item(), abs=1e-6)
    assert out.chosen_ranks[0] == 1


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(n=0),
                                 dict(max_tokens=0), dict(logprobs=99), dict(presence_penalty=3),
                                 dict(min_p=2), dict(stop=[""]), dict(repetition_penalty=0)])
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
