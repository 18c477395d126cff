"""Per-row sampling parameters of one step as flat arrays, built once on the host and read on the device.

A sampled row belongs to a sequence and sits at some offset among that sequence's sampled rows this step
(0 for decode; j for the row scoring the token after the j-th draft of a verify step). Everything that
depends on the row's place in its output (seed keys, min_tokens) uses num_output_tokens + offset.

The host side (SamplingArrays) is plain numpy, so the runner can ship it to the device together with the
batch in one copy; SamplingMetadata holds the device tensors plus the few host scalars that pick code paths.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from lamina.engine.request import Sequence

# Rows with top-k draw from their k most likely tokens (torch.topk) instead of a sorted vocabulary, while
# k <= vocab / CANDIDATE_SHARE (past that a sort costs about the same).
CANDIDATE_SHARE = 8

_PENDING = -1  # lamina.engine.runner.PENDING (a sampled token not read back yet)
_MIX = 0x9E3779B97F4A7C15
_M64 = 0xFFFF_FFFF_FFFF_FFFF


def row_key(seed: int, step: int) -> int:
    """A 32-bit key from (seed, step): splitmix64-style, on Python ints (exact, no overflow)."""
    x = (seed * _MIX + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) & 0xFFFF_FFFF


def needs_history(seq: Sequence) -> bool:
    """Whether sampling this row reads the sequence's earlier tokens (penalties)."""
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass
class SamplingArrays:
    """Host arrays, one entry per sampled row unless said otherwise (see SamplingMetadata for meanings)."""

    temperature: np.ndarray  # float32; 1.0 for greedy rows (unused there)
    greedy: np.ndarray  # bool
    top_k: np.ndarray  # int64 in [1, vocab]; vocab = off
    top_p: np.ndarray  # float32
    log_min_p: np.ndarray  # float32; -inf = off
    keys: np.ndarray  # int64 seed keys (0 where unseeded)
    seeded: np.ndarray  # bool
    # Penalties, as one entry per distinct (row, token) of the penalized rows' histories (prompt + output):
    pen_row: np.ndarray  # int64 [U] the row
    pen_token: np.ndarray  # int64 [U] the token
    pen_out_count: np.ndarray  # float32 [U] its occurrences in the output (presence / frequency)
    pen_repetition: np.ndarray  # float32 [U] the row's repetition penalty (1: off)
    pen_presence: np.ndarray  # float32 [U]
    pen_frequency: np.ndarray  # float32 [U]
    # History tokens still in flight (sampled by the step before, PENDING on the host), one entry each:
    late_row: np.ndarray  # int64 [Q] the row
    late_src: np.ndarray  # int64 [Q] the token's row in the in-flight step's draws (SamplingMetadata.late_tokens)
    late_repetition: np.ndarray  # float32 [Q]
    late_presence: np.ndarray  # float32 [Q]
    late_frequency: np.ndarray  # float32 [Q]
    ban_row: np.ndarray  # int64 [N] (row, token) pairs banned below min_tokens
    ban_token: np.ndarray  # int64 [N]
    # Logits controls: logit_bias entries, and the tokens rows with allowed_token_ids may sample.
    bias_row: np.ndarray  # int64 [B]
    bias_token: np.ndarray  # int64 [B]
    bias_value: np.ndarray  # float32 [B]
    allow_row: np.ndarray  # int64 [A]
    allow_token: np.ndarray  # int64 [A]
    logprob_rows: np.ndarray  # int64 [L] rows that asked for logprobs
    filtered_rows: np.ndarray  # int64: non-greedy rows with top-k or top-p
    unfiltered_rows: np.ndarray  # int64: non-greedy rows without
    vocab: int = 0  # what the arrays were built for (top_k == vocab: off); not shipped


@dataclass
class SamplingMetadata:
    """Device tensors of SamplingArrays (same names) and host scalars choosing the code paths."""

    temperature: torch.Tensor
    greedy: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    log_min_p: torch.Tensor
    keys: torch.Tensor
    seeded: torch.Tensor
    pen_row: torch.Tensor
    pen_token: torch.Tensor
    pen_out_count: torch.Tensor
    pen_repetition: torch.Tensor
    pen_presence: torch.Tensor
    pen_frequency: torch.Tensor
    late_row: torch.Tensor
    late_src: torch.Tensor
    late_repetition: torch.Tensor
    late_presence: torch.Tensor
    late_frequency: torch.Tensor
    ban_row: torch.Tensor
    ban_token: torch.Tensor
    bias_row: torch.Tensor
    bias_token: torch.Tensor
    bias_value: torch.Tensor
    allow_row: torch.Tensor
    allow_token: torch.Tensor
    logprob_rows: torch.Tensor
    filtered_rows: torch.Tensor
    unfiltered_rows: torch.Tensor
    late_tokens: torch.Tensor | None = None  # the in-flight step's sampled tokens (set by the runner)
    # Host-side facts (no device reads needed to branch on them):
    num_rows: int = 0
    all_greedy: bool = True
    any_seeded: bool = False
    max_top_k: int = 0  # largest top_k among rows that set one (0: none)
    any_top_p: bool = False
    any_unfiltered: bool = False  # a sampled (non-greedy) row with neither top-k nor top-p
    any_min_p: bool = False
    num_logprobs: int | None = None  # top logprobs to return (max over rows that ask); None: no row asks
    logprob_rows_cpu: list[int] | None = None  # which rows the logprob outputs are for
    num_filtered: int = 0
    num_unfiltered: int = 0
    seeded_filtered: int = 0  # seeded rows among the filtered ones
    seeded_unfiltered: int = 0
    candidates: int = 0  # candidate-set size of the filtered rows (0: they need the full sort)


def build_arrays(rows: list[Sequence], offsets: list[int] | None, eos: list[int], vocab: int,
                 pending: dict[int, tuple[int, int]] | None = None) -> SamplingArrays:
    """One pass over the sampled rows' parameters (offsets: each row's place among its sequence's sampled
    rows this step; None: all 0). Out-of-range values are clamped here, so the device code never fails.
    pending: where the step in flight samples each sequence's tokens (seq_id -> (index in token_ids of
    the first, its first row in the draws)), for penalized histories that end in tokens not read back yet."""
    n = len(rows)
    offs = offsets if offsets is not None else [0] * n
    temp = np.ones(n, np.float32)
    greedy = np.zeros(n, bool)
    top_k = np.full(n, vocab, np.int64)
    top_p = np.ones(n, np.float32)
    log_min_p = np.full(n, -np.inf, np.float32)
    keys = np.zeros(n, np.int64)
    seeded = np.zeros(n, bool)
    pen_rows, rep, pres, freq = [], [], [], []
    hist_tokens: list[int] = []
    hist_lens, hist_prompt = [], []
    ban_row: list[int] = []
    ban_token: list[int] = []
    lp_rows: list[int] = []
    bias: list[tuple[int, int, float]] = []
    allow: list[tuple[int, int]] = []
    late: list[tuple[int, int, int]] = []  # (row, draws row, index into pen params)
    for r, (seq, off) in enumerate(zip(rows, offs)):
        p = seq.params
        if p.greedy:
            greedy[r] = True
        else:
            temp[r] = p.temperature
        if 0 < p.top_k < vocab:
            top_k[r] = p.top_k
        top_p[r] = p.top_p
        if p.min_p > 0:
            log_min_p[r] = np.log(p.min_p)
        n_out = seq.num_output_tokens + off
        if seq.seed is not None:
            seeded[r] = True
            keys[r] = row_key(seq.seed, n_out)
        if needs_history(seq):
            pen_rows.append(r)
            rep.append(p.repetition_penalty)
            pres.append(p.presence_penalty)
            freq.append(p.frequency_penalty)
            hist_tokens += seq.token_ids
            if off:
                hist_tokens += seq.draft_token_ids[:off]
            hist_lens.append(seq.num_tokens + off)
            hist_prompt.append(seq.num_prompt_tokens)
            if seq.token_ids[-1] == _PENDING:  # only the newest tokens can be in flight
                first = pending.get(seq.seq_id) if pending is not None else None
                if first is None:
                    raise RuntimeError(f"sequence {seq.seq_id} has a token in flight that no launched step samples")
                i = seq.num_tokens - 1
                while i >= first[0] and seq.token_ids[i] == _PENDING:
                    late.append((r, first[1] + i - first[0], len(rep) - 1))
                    i -= 1
        if n_out < p.min_tokens:
            banned = [t for t in p.stop_token_ids if 0 <= t < vocab]
            if not p.ignore_eos:
                banned += [t for t in eos if 0 <= t < vocab]
            ban_row += [r] * len(banned)
            ban_token += banned
        if p.logprobs is not None:
            lp_rows.append(r)
        if p.logit_bias:
            bias += [(r, t, b) for t, b in p.logit_bias.items() if 0 <= t < vocab]
        if p.allowed_token_ids:
            allow += [(r, t) for t in dict.fromkeys(p.allowed_token_ids) if 0 <= t < vocab]
        if p.bad_words_token_ids:  # one-token bad words: always banned (longer ones: the host bitmask)
            single = {w[0] for w in p.bad_words_token_ids if len(w) == 1 and 0 <= w[0] < vocab}
            ban_row += [r] * len(single)
            ban_token += sorted(single)
    pen = _distinct_history(pen_rows, hist_lens, hist_prompt, hist_tokens, vocab)
    row_params = [np.asarray(x, np.float32) for x in (rep, pres, freq)]
    late_a = np.asarray(late, np.int64).reshape(-1, 3)
    return SamplingArrays(
        temp, greedy, top_k, top_p, log_min_p, keys, seeded,
        np.asarray(pen_rows, np.int64)[pen[0]], pen[1], pen[2], *(x[pen[0]] for x in row_params),
        late_a[:, 0].copy(), late_a[:, 1].copy(), *(x[late_a[:, 2]] for x in row_params),
        np.asarray(ban_row, np.int64), np.asarray(ban_token, np.int64),
        np.asarray([b[0] for b in bias], np.int64), np.asarray([b[1] for b in bias], np.int64),
        np.asarray([b[2] for b in bias], np.float32), np.asarray([a[0] for a in allow], np.int64),
        np.asarray([a[1] for a in allow], np.int64), np.asarray(lp_rows, np.int64),
        np.flatnonzero(~greedy & ((top_k < vocab) | (top_p < 1.0))),
        np.flatnonzero(~greedy & (top_k >= vocab) & (top_p >= 1.0)), vocab)


def _distinct_history(rows: list[int], lens: list[int], prompt: list[int], tokens: list[int],
                      vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index into rows, token, output occurrences) of each distinct (row, token) of the histories (row i
    owns the next lens[i] tokens, the first prompt[i] of them its prompt): vectorized, so the device applies
    every penalty with one gather and one scatter and no duplicate writes."""
    lens_a = np.asarray(lens, np.int64)
    tok = np.asarray(tokens, np.int64)
    local = np.repeat(np.arange(len(lens_a)), lens_a)
    in_row = np.arange(tok.size) - np.repeat(np.cumsum(lens_a) - lens_a, lens_a)
    is_out = in_row >= np.repeat(np.asarray(prompt, np.int64), lens_a)
    keep = (tok >= 0) & (tok < vocab)  # the engine never leaves a token in flight here; out of range: ignored
    keys, inverse = np.unique(local[keep] * vocab + tok[keep], return_inverse=True)
    out_count = np.bincount(inverse, weights=is_out[keep], minlength=keys.size).astype(np.float32)
    return keys // vocab, keys % vocab, out_count


def metadata_from(arrays: SamplingArrays, tensors: list[torch.Tensor], rows: list[Sequence]) -> SamplingMetadata:
    """SamplingMetadata over `tensors` (the arrays' device copies, in field order) plus the host facts."""
    a = arrays
    f, u = a.filtered_rows, a.unfiltered_rows
    k = a.top_k[f]
    has_k = k < a.vocab
    # Filtered rows draw from their top-k' tokens (k' the largest top-k) when all of them set a top-k: a
    # top-p row without one may need any number of tokens, so it sorts the vocabulary (exact, sync-free).
    cand = int(k.max(initial=0)) if has_k.all() else 0
    nums = [s.params.logprobs for s in rows if s.params.logprobs is not None]
    return SamplingMetadata(
        *tensors, num_rows=len(a.greedy), all_greedy=bool(a.greedy.all()), any_seeded=bool(a.seeded.any()),
        max_top_k=int(k[has_k].max(initial=0)), any_top_p=bool((a.top_p[~a.greedy] < 1.0).any()),
        any_unfiltered=bool(u.size), any_min_p=bool((a.log_min_p[~a.greedy] > -np.inf).any()),
        num_logprobs=max(nums) if nums else None, logprob_rows_cpu=a.logprob_rows.tolist(),
        num_filtered=int(f.size), num_unfiltered=int(u.size), seeded_filtered=int(a.seeded[f].sum()),
        seeded_unfiltered=int(a.seeded[u].sum()),
        candidates=cand if cand * CANDIDATE_SHARE <= a.vocab else 0)


def array_list(arrays: SamplingArrays) -> list[np.ndarray]:
    """The arrays to ship, in SamplingMetadata's field order."""
    return [getattr(arrays, f.name) for f in fields(arrays) if f.name != "vocab"]


def to_device(arrays: SamplingArrays, rows: list[Sequence], device: torch.device) -> SamplingMetadata:
    """The plain path (tests, callers without a staging buffer): one small copy per array."""
    return metadata_from(arrays, [torch.from_numpy(x).to(device) for x in array_list(arrays)], rows)
