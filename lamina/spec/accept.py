"""Acceptance of a verify step's drafts, on the device.

A verify step samples every row of a sequence from the target model's distribution at that position (row j
scores the token after draft j-1, with penalties, min_tokens and the seed key of output index n_out + j as a
plain step would use there). A draft stands while the sampled token at its row equals it; the first row that
differs emits its sampled token instead, and when all K stand the last row's token is the bonus token.

For drafts without a distribution (ngram, greedy drafters: q is one-hot) this is exactly the rejection rule:
the draft d is kept with probability p(d) = min(1, p(d)/q(d)), and a rejected row's token, drawn from p and
known to differ from d, is distributed as the normalized residual max(0, p - q). Seeded rows draw the same
token at each output index as without speculation, so their outputs are identical too.
"""
from __future__ import annotations

import numpy as np
import torch

from lamina.engine.request import Sequence
from lamina.engine.runner import to_device


def verify_rows(sampled: list[tuple[Sequence, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host layout of a step's sampled rows, from InFlight.sampled ((sequence, first index, rows) in row order):
    per row the draft it verifies (-1 for a sequence's last row), its sequence's index and its offset."""
    counts = np.fromiter((n for _, _, n in sampled), np.int64, len(sampled))
    drafts: list[int] = []
    for seq, _, n in sampled:
        if n > 1:
            drafts += seq.draft_token_ids[:n - 1]
        drafts.append(-1)
    row_seq = np.repeat(np.arange(len(sampled)), counts)
    row_off = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.asarray(drafts, np.int64), row_seq, row_off


def count_accepted(tokens: torch.Tensor, row_draft: torch.Tensor, row_seq: torch.Tensor, row_off: torch.Tensor,
                   num_seqs: int) -> torch.Tensor:
    """Accepted drafts per sequence [num_seqs] (int64): the offset of its first row whose sampled token differs
    from the draft that row verifies (its last row verifies none, so the count is at most its drafts)."""
    stop = torch.where(tokens == row_draft, torch.iinfo(torch.int64).max, row_off)
    out = torch.full((num_seqs,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=tokens.device)
    return out.scatter_reduce_(0, row_seq, stop, reduce="amin")


def accepted_on_device(tokens: torch.Tensor, sampled: list[tuple[Sequence, int, int]],
                       forced: np.ndarray | None = None) -> torch.Tensor:
    """count_accepted for a step's sampled rows (tokens: the step's draws, on the device).

    forced (bench only: the replay proposer's forced acceptance): per sampled sequence the accepted count to
    report instead (at most its drafts). The count is still computed, so the device runs the same work as a
    real verify step; only which count stands changes (the engine then keeps the drafts, not the draws)."""
    row_draft, row_seq, row_off = verify_rows(sampled)
    dev = tokens.device
    counted = count_accepted(tokens, to_device(row_draft, dev), to_device(row_seq, dev), to_device(row_off, dev),
                             len(sampled))
    if forced is None:
        return counted
    override = to_device(np.asarray(forced, np.int64), dev)
    return torch.where(override >= 0, override, counted)
