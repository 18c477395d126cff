"""Prompt-lookup (n-gram) proposer: the sequence's last n tokens are searched for among its earlier tokens
(prompt and output), and the tokens that followed its latest earlier occurrence (with k tokens after it)
are proposed. Tried from n = prompt_lookup_max down to prompt_lookup_min; no weights, host-only numpy."""
from __future__ import annotations

import numpy as np

from lamina.engine.request import Sequence


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens following an earlier occurrence of the longest suffix of `tokens` (length in
    [n_min, n_max]) that occurs earlier; [] if none does."""
    size = tokens.shape[0]
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:]
        # Windows starting at 0 .. size-n-1 (an occurrence that ends before the suffix's own last token).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # The latest occurrence with k tokens after it, else the earliest (the longest continuation):
            # inside a repeating run the latest one is followed by only a few tokens.
            full = hits[hits + n + k <= size]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        return [ngram_lookup(np.asarray(s.token_ids, np.int64), self.n_min, self.n_max, k) for s in seqs]
