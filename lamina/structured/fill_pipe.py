"""The decode step's grammar work in two xgrammar calls, on a worker the step loop never waits to start
(LAMINA_GRAMMAR_FILL_PIPE=1; MaskFiller.pipe).

xgrammar 0.2.9's calls go through tvm-ffi, whose functions release the interpreter lock for the call
(tvm_ffi Function.release_gil, on by default). A short call mostly gets the lock back before a waiting thread
wakes (is_terminated: 0.2 us alone, 1.2 us with a spinning thread, development machine); a long one lets the
waiting thread in, and the caller then waits for it to let go (a blocking call, or the switch interval). The
default hand-off (fill.py) has the step loop wait, blocked, while the worker wakes up, takes the rows'
tokens one accept_token call at a time and reaches the batch fill: filler_start 748 us a step at 64 rows on the
H200 host, of which accept_all 244 us (2026-12-02), the rest thread wake-ups.

Here a step's single-row grammars take their queued tokens in ONE BatchGrammarMatcher.batch_accept_token call
and are filled by ONE batch_fill_next_token_bitmask call (xgrammar's own threads), both on the raw tvm-ffi
handles (no per-row Python wrappers). The step loop only sorts the rows (one loop, ~9 us at 64 rows), queues
the job and goes on building the step; the worker needs the lock to start, between the two calls and to
finish, for a few microseconds of Python each time. It gets it when the loop lets go (a blocking call, a
long torch call) or at the switch interval: LAMINA_GRAMMAR_FILL_SWITCH_US (e.g. 200) bounds that wait while
a fill is pending. accept_on_loop: the batch accept runs on the step loop instead (the worker needs the lock
twice, and the loop pays the accept).

Rows whose queued tokens are not exactly one (rare: several after a preemption) or hold a stop token (the
grammar may end there) are advanced on the step loop first, as advance_all does; the worker handles only a
rejected token (a bug: the mask forbids it), by marking the state broken and leaving its row all ones.
"""
from __future__ import annotations

import logging
import queue
import threading

import torch

from lamina.structured.bitmask import ALL_ALLOWED

log = logging.getLogger("lamina")


class Plan:
    """A step's grammar work for the pipe: accept tokens[i] by handles[i] in one batch call, then fill host
    rows `rows` from `states` (their matchers: fill_handles) in one batch call; `ended`: rows whose state
    ended before (for the caller to set all ones)."""

    __slots__ = ("states", "rows", "handles", "tokens", "ended", "fill_handles")

    def __init__(self, states, rows, handles, tokens, ended, fill_handles) -> None:
        self.states, self.rows, self.handles, self.tokens = states, rows, handles, tokens
        self.ended, self.fill_handles = ended, fill_handles


def split_pending(states: list, rows: list[int]) -> Plan:
    """The Plan of `states` (filling host rows `rows`): a state with one queued token that is not a stop token
    goes to the batch accept; any other queue is taken here (state.flush), and a state that ends so leaves
    the fill. The usual decode step (one token each, none a stop token) is one loop over the rows."""
    handles, tokens, odd = [], [], []
    for i, s in enumerate(states):
        p = s.pending
        if p:
            t = p[0]
            if len(p) == 1 and t not in s.stops:
                handles.append(s.handle)
                tokens.append(t)
                s.pending = []
                s.num_accepted += 1  # taken back if the batch accept rejects it (accept_batch)
                continue
            odd.append(i)
    if not odd:
        return Plan(states, rows, handles, tokens, [], handles if len(handles) == len(states) else None)
    for i in odd:
        states[i].flush()
    fill_states, fill_rows, ended = [], [], []
    for s, r in zip(states, rows):
        if s.done:
            ended.append(r)
        else:
            fill_states.append(s)
            fill_rows.append(r)
    return Plan(fill_states, fill_rows, handles, tokens, ended, None)


def accept_batch(plan: Plan, host: torch.Tensor) -> None:
    """The plan's batch accept; a rejected token breaks its state, whose row is set all ones and left out of
    the plan's fill."""
    if not plan.handles:
        return
    import xgrammar as xg

    handles, tokens = plan.handles, plan.tokens
    plan.handles = plan.tokens = ()  # taken: a second call accepts nothing
    res = xg.base._core.BatchGrammarMatcher.batch_accept_token(handles, tokens, False)
    if 0 not in res:  # the usual step: a C-level scan of the result, no per-row Python
        return
    bad = {h: t for h, t, ok in zip(handles, tokens, res) if not ok}
    keep_s, keep_r = [], []
    for s, r in zip(plan.states, plan.rows):
        if s.handle in bad:
            s.num_accepted -= 1
            s._reject(bad[s.handle])
            host[r].numpy().fill(ALL_ALLOWED)
        else:
            keep_s.append(s)
            keep_r.append(r)
    plan.states, plan.rows, plan.fill_handles = keep_s, keep_r, None


def fill_batch(batch, plan: Plan, host: torch.Tensor) -> None:
    """The plan's batch fill of its host rows (whole rows written); batch: a BatchGrammarMatcher."""
    states, rows = plan.states, plan.rows
    if not states:
        return
    handles = plan.fill_handles if plan.fill_handles is not None else [s.handle for s in states]
    identity = len(rows) == host.shape[0] and rows[0] == 0 and rows[-1] == len(rows) - 1
    batch._handle.batch_fill_next_token_bitmask(handles, host, None if identity else rows, False)


class PipeJob:
    """One step's accept-and-fill queued on the PipeWorker; wait() returns once it ran (re-raising its error)."""

    __slots__ = ("run", "error", "_done")

    def __init__(self, run) -> None:
        self.run, self.error = run, None
        self._done = threading.Lock()
        self._done.acquire()

    def finish(self) -> None:
        self._done.release()

    def result(self) -> None:
        """Waits for the job (PendingFill calls it as it calls a Future's)."""
        if self._done is None:
            return
        self._done.acquire()  # blocks without the interpreter lock until the worker releases it
        self._done = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err


class PipeWorker:
    """One daemon thread running queued PipeJobs in order: a bare queue and a lock, the least Python between
    waking up and the first xgrammar call."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="lamina-grammar-pipe", daemon=True)
        self._thread.start()

    def submit(self, run) -> PipeJob:
        job = PipeJob(run)
        self._queue.put(job)
        return job

    def _loop(self) -> None:
        get = self._queue.get
        while True:
            job = get()
            if job is None:
                return
            try:
                job.run()
            except BaseException as exc:  # reported by wait(), on the step loop
                job.error = exc
            job.finish()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
