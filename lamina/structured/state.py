"""GrammarState: one sequence's position in its grammar (an xgrammar matcher), advanced with each token the
engine accepts for it, and the source of its rows of a step's token bitmask.

The step loop only queues a read-back token (push: a list append); the matcher takes the queued tokens when
the next mask is filled (advance_all, on the filler's worker, in one tight loop). Accepting in the read-back
cost ~6 us a row of Python and C++ calls on the step loop (accept 396 us a step at 64 rows on the H200 host,
scripts/gpu_vllm.sh structured, 2026-12-02).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("lamina")


class GrammarState:
    """Wraps an xgrammar GrammarMatcher over a CompiledGrammar.

    Contract: push() (or accept()) is called with every output token of the sequence, in order, exactly once
    (the engine does so when it reads the token back). A preempted sequence keeps its tokens and so its
    state; nothing is replayed. A token the grammar rejects (which the mask prevents, short of a bug) makes
    the state `broken`: its rows go unmasked from then on rather than failing the batch.
    `done` (broken, or a stop token accepted) is known without the queued tokens; `terminated` takes them.
    """

    def __init__(self, compiled, ws=None) -> None:
        import xgrammar as xg

        self.matcher = xg.GrammarMatcher(compiled)
        self.handle = self.matcher._handle  # its tvm-ffi object: xgrammar's batch calls on raw handles (fill_pipe.py)
        self.stops = frozenset(self.matcher.stop_token_ids)  # accepting one of these terminates the matcher
        self.pending: list[int] = []  # read back, not yet given to the matcher
        self.num_accepted = 0
        self.broken = False
        self.done = False  # broken or terminated, as of the tokens the matcher has taken
        # JSON whitespace bounded on the host (structured/whitespace.py): its tables, and the output's trailing
        # run of whitespace, kept as tokens are pushed (the matcher need not have taken them)
        self.ws = ws
        self.ws_run = 0

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token (or broke): nothing more is constrained."""
        self.flush()
        return self.done

    def push(self, token: int) -> None:
        """Queues a read-back token; the matcher takes it at the next flush (the next mask's fill)."""
        self.pending.append(token)
        if self.ws is not None:
            s = self.ws.step[token] if 0 <= token < len(self.ws.step) else 0
            self.ws_run = self.ws_run - s if s < 0 else s

    def flush(self) -> None:
        """Gives the queued tokens to the matcher, one call each."""
        tokens, self.pending = self.pending, []
        for t in tokens:
            self._take(t)

    def accept(self, token: int) -> bool:
        """Accepts a token now (after the queued ones); False if the grammar rejected it."""
        self.flush()
        if self.ws is not None:
            self.ws_run = self.ws.run_after(self.ws_run, (token,))
        return self._take(token)

    def _take(self, token: int) -> bool:
        if self.done:
            return True
        if not self.matcher.accept_token(token):
            self._reject(token)
            return False
        self._accepted(token)
        return True

    def _accepted(self, token: int) -> None:
        self.num_accepted += 1
        if token in self.stops:
            self.done = self.matcher.is_terminated()

    def _reject(self, token: int) -> None:
        log.warning("grammar rejected token %d after %d tokens; the rest is unconstrained", token, self.num_accepted)
        self.broken = self.done = True

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] | None = None, count: int = 1) -> None:
        """Fills bitmask rows row .. row+count-1 (int32 on the host, all ones beforehand): row + j allows what
        may follow the accepted tokens plus drafts[:j] (verify steps). Rows after a draft the grammar
        rejects stay all ones: the verify step rejects that draft anyway."""
        self.flush()
        m, advanced = self.matcher, 0
        for j in range(count):
            if j:
                if m.is_terminated() or not m.accept_token(drafts[j - 1]):
                    break
                advanced += 1
            if self.done or m.is_terminated():
                break
            m.fill_next_token_bitmask(bitmask, row + j)
        if advanced:
            m.rollback(advanced)

def advance_all(states: list[GrammarState]) -> None:
    """flush() for every state, in one tight loop for the usual one token each. Not xgrammar's
    BatchGrammarMatcher.batch_accept_token: it holds the interpreter lock too and took 200-245 us for 64
    matchers against 122-153 us for 64 accept_token calls (development machine, /tmp probe, 2026-12-02)."""
    for s in states:
        p = s.pending
        if not p:
            continue
        s.pending = []
        if len(p) == 1 and not s.done:
            t = p[0]
            if s.matcher.accept_token(t):
                s.num_accepted += 1
                if t in s.stops:
                    s.done = s.matcher.is_terminated()
            else:
                s._reject(t)
        else:
            for t in p:
                s._take(t)
