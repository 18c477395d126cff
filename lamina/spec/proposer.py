"""The proposer interface: guesses of the tokens that follow each sequence, verified by the target model.

A proposer sees sequences whose tokens are all known (none in flight) and whose next step is a decode step;
it returns, per sequence, at most k draft tokens (fewer or none where it has no guess). The guesses cost no
correctness: the verify step keeps a draft only where the target model would have produced it, so a proposer
with no distribution (ngram, greedy drafters) is lossless for greedy and sampled requests alike.
"""
from __future__ import annotations

from typing import Protocol

from lamina.engine.request import Sequence


class Proposer(Protocol):
    """A proposer may also set `needs_hidden_states = True` and implement observe(scheduled, hidden): it is
    then handed every target step's backbone output [tokens, H] (rows in the step's scheduled order), before
    the step commits (spec/mtp.py)."""

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        """Per sequence (same order), its draft tokens: a list of at most k token ids."""
        ...
