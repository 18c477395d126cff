"""Unit pieces of speculative decoding: the config's checks, n-gram lookup, device-side acceptance counts,
and the general rejection rule against exact distributions (chi-square, with draft distributions q)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lamina.spec.accept import count_accepted
from lamina.spec.config import parse_speculative_config
from lamina.spec.ngram import ngram_lookup
from lamina.spec.rejection import rejection_sample


def test_config_defaults_and_json():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 1, 4)
    assert parse_speculative_config(cfg.to_dict()) == cfg
    assert parse_speculative_config({"model": "/x", "num_speculative_tokens": 2}).method == "draft_model"
    assert parse_speculative_config({"method": "self_spec", "num_speculative_tokens": 2,
                                     "skip_layers": [3, 1, 3]}).skip_layers == (1, 3)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("raw, words", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "> prompt"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no option(s) model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ("{not json", "not valid JSON"),
    ([1], "must be a JSON object"),
])
def test_config_refusals_are_one_line(raw, words):
    with pytest.raises(ValueError, match=None) as e:
        parse_speculative_config(raw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_ngram_lookup():
    t = np.asarray([5, 6, 7, 8, 9, 1, 5, 6, 7], np.int64)
    assert ngram_lookup(t, 1, 3, 3) == [8, 9, 1]  # "5 6 7" seen before, followed by 8 9 1
    assert ngram_lookup(t, 1, 3, 10) == [8, 9, 1, 5, 6, 7]  # clipped at the end of the sequence
    assert ngram_lookup(np.asarray([1, 2, 3], np.int64), 1, 3, 2) == []  # no earlier occurrence
    run = np.asarray([4, 1, 2, 1, 2, 1, 2], np.int64)  # inside a repeating run: a long continuation wins
    assert ngram_lookup(run, 2, 2, 3) == [1, 2, 1]
    assert ngram_lookup(np.asarray([3, 9, 3], np.int64), 2, 4, 2) == []  # below prompt_lookup_min


def test_count_accepted():
    # three sequences: 2 drafts (first right, second wrong), 0 drafts, 3 drafts all right
    tokens = torch.tensor([10, 99, 7, 3, 1, 2, 3, 4])
    row_draft = torch.tensor([10, 11, -1, -1, 1, 2, 3, -1])
    row_seq = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    row_off = torch.tensor([0, 1, 2, 0, 0, 1, 2, 3])
    assert count_accepted(tokens, row_draft, row_seq, row_off, 3).tolist() == [1, 0, 3]


def _random_probs(gen, shape, v, zero_share=0.3):
    x = torch.rand(*shape, v, generator=gen) ** 3
    x = x * (torch.rand(*shape, v, generator=gen) > zero_share)  # some zeros, as top-k / top-p leave
    x[..., 0] += 1e-3
    return x / x.sum(-1, keepdim=True)


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one-hot"])
def test_rejection_rule_emits_target_distribution(with_q):
    """Position-independent targets p_0, p_1, p_2 (K = 2): the first emitted token is distributed as p_0,
    the second (when the first draft stood) as p_1, whatever the drafts' distribution q; drafts are drawn
    from q. Chi-square against the exact p, with a control (drafts always kept) that must fail."""
    gen = torch.Generator().manual_seed(0)
    v, k, b = 6, 2, 40000
    p = _random_probs(gen, (k + 1,), v)
    q = _random_probs(gen, (k,), v, zero_share=0.0)
    drafts = torch.stack([torch.multinomial(q[j], b, replacement=True, generator=gen) for j in range(k)], 1)
    if not with_q:
        drafts = torch.stack([torch.full((b,), int(p[j].argmax())) for j in range(k)], 1)
    target = p[None].expand(b, k + 1, v)
    draft_probs = q[None].expand(b, k, v) if with_q else None
    tokens, acc = rejection_sample(target, drafts, torch.full((b,), k), draft_probs, generator=gen)
    assert ((tokens >= 0).sum(1) == acc + 1).all()
    assert (tokens[:, :k][torch.arange(k)[None] < acc[:, None]] == drafts[torch.arange(k)[None] < acc[:, None]]).all()

    def chi2(sample, probs, strict=True):
        counts = torch.bincount(sample, minlength=v).double()
        expect = probs.double() * sample.numel()
        keep = expect > 0
        if counts[~keep].sum():  # a token the target rules out
            assert not strict
            return float("inf"), 1
        return float(((counts - expect)[keep] ** 2 / expect[keep]).sum()), int(keep.sum()) - 1

    limit = lambda df: df + 3.09 * math.sqrt(2 * df) + 3  # noqa: E731 (~ 0.1% upper quantile)
    stat, df = chi2(tokens[:, 0], p[0])
    assert stat < limit(df), stat
    second = tokens[acc >= 1, 1]
    assert 1000 < second.numel() < b  # drafts both stand and fall often
    stat, df = chi2(second, p[1])
    assert stat < limit(df), stat
    # control: keeping every draft emits q (or the one-hot draft), not p
    stat, df = chi2(drafts[:, 0], p[0], strict=False) if with_q else (1e9, 1)
    assert stat > limit(df)


def test_rejection_fewer_drafts_and_bonus():
    """num_drafts < K: the bonus comes from p at position num_drafts; a sure draft (p(d) = 1) always stands."""
    v = 4
    p = torch.zeros(1, 3, v)
    p[0, 0, 2] = 1.0
    p[0, 1, 3] = 1.0
    p[0, 2, 1] = 1.0
    tokens, acc = rejection_sample(p, torch.tensor([[2, 0]]), torch.tensor([1]))
    assert acc.tolist() == [1] and tokens.tolist() == [[2, 3, -1]]
    tokens, acc = rejection_sample(p, torch.tensor([[1, 0]]), torch.tensor([2]))  # p(1) = 0 at position 0
    assert acc.tolist() == [0] and tokens.tolist() == [[2, -1, -1]]
