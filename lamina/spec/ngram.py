"""Prompt-lookup (n-gram) proposer: the sequence's last n tokens are searched for among its earlier tokens
(prompt and output), and the tokens that followed its latest earlier occurrence (with k tokens after it)
are proposed. Tried from n = prompt_lookup_max down to prompt_lookup_min; no weights, host-only numpy.

It runs between a verify step's read-back and the next launch, once per sequence, so it is built to cost little
per sequence: each sequence's tokens live in a numpy buffer that only its new tokens are appended to (not a
list converted every step), and the search looks only at the positions holding the last token (one compare
over the tokens), then measures how far each of those matches backwards (a [hits, n_max] gather), instead of
comparing every window for every n. ngram_lookup is the plain definition it is tested against.
"""
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


def ngram_lookup_fast(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """ngram_lookup, the same result: candidate occurrences are the earlier positions c holding the last token;
    each one's match length (how many tokens ending at c equal the suffix, at most n_max and c + 1) says for
    which n it is a hit (an occurrence of the n-suffix ends at c when its length >= n)."""
    size = tokens.shape[0]
    top = min(n_max, size - 1)
    if top < n_min or top < 1:
        return []
    ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1])
    if not ends.size:
        return []
    if top > 1:
        back = np.arange(top)
        idx = ends[:, None] - back  # [hits, top]: the tokens ending at each candidate, read backwards
        ok = (idx >= 0) & (tokens[np.maximum(idx, 0)] == tokens[size - 1 - back])
        length = ok.cumprod(axis=1).sum(axis=1)  # leading matches
    else:
        length = np.ones(ends.size, np.int64)
    n = int(length.max())
    if n < n_min:
        return []
    hits = ends[length >= n]  # occurrences of the longest suffix that occurs earlier, by where they end
    full = hits[hits + 1 + k <= size]
    start = int(full[-1] if full.size else hits[0]) + 1
    return tokens[start:start + k].tolist()


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self._bufs: dict[int, tuple[Sequence, np.ndarray, int]] = {}  # seq_id -> (sequence, buffer, tokens in it)

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """The sequence's tokens as an int64 array (its buffer, grown by the tokens added since last time).
        A proposer only sees sequences whose tokens are all known, and a running sequence's known tokens never
        change (a stop cuts them, but the sequence has finished then); any other change starts a new buffer."""
        ids = seq.token_ids
        size = len(ids)
        got = self._bufs.get(seq.seq_id)
        if got is None or got[0] is not seq or got[2] > size:
            buf = np.empty(max(2 * size, 64), np.int64)
            buf[:size] = ids
        else:
            buf, n = got[1], got[2]
            if size > buf.shape[0]:
                grown = np.empty(2 * size, np.int64)
                grown[:n] = buf[:n]
                buf = grown
            if size > n:
                buf[n:size] = ids[n:]
        self._bufs[seq.seq_id] = (seq, buf, size)
        return buf[:size]

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        if len(self._bufs) > 2 * len(seqs) + 64:  # sequences that ended: dropped (rebuilt if they come back)
            live = {s.seq_id for s in seqs}
            self._bufs = {sid: v for sid, v in self._bufs.items() if sid in live}
        return [ngram_lookup_fast(self._tokens(s), self.n_min, self.n_max, k) for s in seqs]
