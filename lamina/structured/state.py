"""GrammarState: one sequence's position in its grammar (an xgrammar matcher), advanced with each token the
engine accepts for it, and the source of its rows of a step's token bitmask."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("lamina")


class GrammarState:
    """Wraps an xgrammar GrammarMatcher over a CompiledGrammar.

    Contract: accept() is called with every output token of the sequence, in order, exactly once (the
    engine does so when it reads the token back). A preempted sequence keeps its tokens and so its state;
    nothing is replayed. A token the grammar rejects (which the mask prevents, short of a bug) makes the
    state `broken`: its rows go unmasked from then on rather than failing the batch.
    """

    def __init__(self, compiled) -> None:
        import xgrammar as xg

        self.matcher = xg.GrammarMatcher(compiled)
        self.num_accepted = 0
        self.broken = False

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more is constrained."""
        return self.broken or self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        if self.terminated:
            return True
        if not self.matcher.accept_token(token):
            log.warning("grammar rejected token %d after %d tokens; the rest is unconstrained", token,
                        self.num_accepted)
            self.broken = True
            return False
        self.num_accepted += 1
        return True

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] | None = None, count: int = 1) -> None:
        """Fills bitmask rows row .. row+count-1 (int32 on the host, all ones beforehand): row + j allows what
        may follow the accepted tokens plus drafts[:j] (verify steps). Rows after a draft the grammar
        rejects stay all ones: the verify step rejects that draft anyway."""
        advanced = 0
        for j in range(count):
            if j:
                if self.terminated or not self.matcher.accept_token(drafts[j - 1]):
                    break
                advanced += 1
            if self.terminated:
                break
            self.matcher.fill_next_token_bitmask(bitmask, row + j)
        if advanced:
            self.matcher.rollback(advanced)
