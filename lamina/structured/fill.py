"""Filling a step's token bitmask off the step loop's thread, so the fill runs while that thread builds the
step and runs (or launches) its forward.

Which of xgrammar's fills (0.2.9) release the interpreter lock, measured on the development machine
(scripts/grammar_fill_gil.py, BENCHMARKS.md: a pure-Python counter thread, 64 matchers of the bench schema in
a string): GrammarMatcher.fill_next_token_bitmask HOLDS it (311 of 320 single-row calls of ~0.7 ms each let
the counter make no progress at all), while BatchGrammarMatcher.batch_fill_next_token_bitmask RELEASES it
(the counter ran at its free rate through every 40 ms call). So a pool of Python threads each filling rows one
matcher at a time ran the rows one after another under the lock, and took it from the step loop for each row:
on the H200 host at 64 rows, fill_row summed 9.8 ms over 8 threads against 3.1 ms on one, and the batch build
(prepare) took 2.6 ms against 1.3 ms (scripts/gpu_vllm.sh structured, 2026-12-02).

Here a step's single-row grammars first take their queued tokens (structured/state.py: advance_all) and are
then filled by one batch call (xgrammar's own C++ threads, sized to the
rows) on one worker thread: one hand-off per step, and the step loop keeps the lock while the rows fill.
Verify runs (a row per draft: accept, fill, roll back) follow in the same worker call, one matcher at a time.

The step loop waits for the worker to reach the batch fill (LAMINA_GRAMMAR_FILL_WAIT_START, default 1): a
thread waiting for the interpreter lock gets it only when the holder blocks or after the 5 ms switch interval
(each release by the holder restarts that wait), so while the step loop builds the batch (Python, with torch
calls releasing the lock for microseconds) the worker could not even start, and the fill ran when the step
loop blocked on it (scripts/structured_host_step.py). The wait costs the step loop the worker's wake-up and
its accepts.

Threads: LAMINA_GRAMMAR_FILL_THREADS (default min(8, usable cores // 2), at least 1) caps xgrammar's threads,
at most one per ROWS_PER_THREAD rows; 0 fills on the calling thread with one thread (no overlap). Fewer rows
than LAMINA_GRAMMAR_FILL_MIN_ROWS (default ROWS_PER_THREAD) are filled on the calling thread at once: handing
1-2 rows to a thread cost the loop ~0.35 ms on the loaded 2-core machine, measured while the per-matcher fill
still held the lock; the H200 run with it at 1 says whether that still holds (scripts/gpu_vllm.sh). An
idle xgrammar pool sleeps (measured: 0-10 ms of CPU over 1 s idle after fills, 1 to 4 threads).

LAMINA_GRAMMAR_FILL_ACCEPT_ON_LOOP=1 (opt-in until measured on the H200): the step loop takes the queued tokens
itself before the hand-off. The accepts hold the lock wherever they run (xgrammar's accept_token, per-matcher
fill and batch_accept_token all do: scripts/grammar_fill_gil.py), so moving them costs the loop nothing extra,
and the worker then needs the lock only to enter the batch fill: with LAMINA_GRAMMAR_FILL_WAIT_START=0 the
loop no longer waits two thread wake-ups per step. LAMINA_GRAMMAR_FILL_SWITCH_US (unset: the interpreter's
5 ms) lowers the switch interval while a fill is pending, so the worker gets the lock within that long
although the loop runs Python; the interval is put back when the fill is waited for.

LAMINA_GRAMMAR_FILL_PIPE=1 (opt-in until measured on the H200): structured/fill_pipe.py, the decode step's
tokens in one batch accept and its rows in one batch fill, on a worker the loop does not wait for.
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lamina.structured.bitmask import ALL_ALLOWED
from lamina.structured.fill_pipe import PipeWorker, accept_batch, fill_batch, split_pending
from lamina.structured.state import GrammarState, advance_all

ROWS_PER_THREAD = 8  # ~15-40 us a row on the H200 host: fewer rows per thread cost more to hand off than they save
ENV_THREADS = "LAMINA_GRAMMAR_FILL_THREADS"
ENV_MIN_ROWS = "LAMINA_GRAMMAR_FILL_MIN_ROWS"
ENV_WAIT_START = "LAMINA_GRAMMAR_FILL_WAIT_START"
ENV_ACCEPT_ON_LOOP = "LAMINA_GRAMMAR_FILL_ACCEPT_ON_LOOP"
ENV_SWITCH_US = "LAMINA_GRAMMAR_FILL_SWITCH_US"
ENV_PIPE = "LAMINA_GRAMMAR_FILL_PIPE"


def default_fill_threads() -> int:
    """LAMINA_GRAMMAR_FILL_THREADS if set (>= 0), else min(8, usable cores // 2), at least 1."""
    value = os.environ.get(ENV_THREADS)
    if value is not None and value.strip():
        n = int(value)
        if n < 0:
            raise ValueError(f"{ENV_THREADS} must be >= 0, got {n}")
        return n
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(8, cores // 2))


def default_min_rows() -> int:
    """LAMINA_GRAMMAR_FILL_MIN_ROWS if set (>= 1), else ROWS_PER_THREAD: the fewest rows filled in the background."""
    value = os.environ.get(ENV_MIN_ROWS)
    if value is None or not value.strip():
        return ROWS_PER_THREAD
    if int(value) < 1:
        raise ValueError(f"{ENV_MIN_ROWS} must be >= 1, got {value}")
    return int(value)


def default_switch_us() -> float | None:
    """LAMINA_GRAMMAR_FILL_SWITCH_US if set (> 0), else None: the switch interval is left alone."""
    value = os.environ.get(ENV_SWITCH_US)
    if value is None or not value.strip():
        return None
    if float(value) <= 0:
        raise ValueError(f"{ENV_SWITCH_US} must be > 0, got {value}")
    return float(value)


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip() != "0"


def batch_threads(rows: int, threads: int) -> int:
    """xgrammar threads for a batch fill of `rows`: one per ROWS_PER_THREAD rows, at most `threads`, at least 1."""
    return max(1, min(threads, rows // ROWS_PER_THREAD))


Job = Callable[[], None]  # fills some rows of the host bitmask; jobs touch disjoint rows and matchers


class PendingFill:
    """A fill started on the filler's worker (or already done); wait() returns once it has run and re-raises
    its error (and puts back the switch interval the start lowered, if it did)."""

    def __init__(self, future: Future | None, switch_s: float | None = None) -> None:
        self._future = future
        self._switch_s = switch_s  # the interval to restore

    def wait(self) -> None:
        f, self._future = self._future, None
        try:
            if f is not None:
                f.result()  # a Future, or fill_pipe.PipeJob
        finally:
            if self._switch_s is not None:
                sys.setswitchinterval(self._switch_s)
                self._switch_s = None


class MaskFiller:
    """Runs a step's fill on one worker thread (made on the first background fill); not thread-safe: one
    caller, one fill at a time (the caller waits for a fill before starting the next)."""

    def __init__(self, threads: int | None = None, min_rows: int | None = None, wait_start: bool | None = None,
                 accept_on_loop: bool | None = None, switch_us: float | None = None, pipe: bool | None = None) -> None:
        self.threads = default_fill_threads() if threads is None else threads
        self.min_rows = default_min_rows() if min_rows is None else min_rows
        self.wait_start = _flag(ENV_WAIT_START, "1") if wait_start is None else wait_start
        self.accept_on_loop = _flag(ENV_ACCEPT_ON_LOOP, "0") if accept_on_loop is None else accept_on_loop
        self.switch_us = default_switch_us() if switch_us is None else switch_us
        self.pipe = _flag(ENV_PIPE, "0") if pipe is None else pipe  # fill_pipe.py: two batch calls, no start wait
        self._pool: ThreadPoolExecutor | None = None
        self._pipe: PipeWorker | None = None
        self._batch: dict[int, object] = {}  # xgrammar BatchGrammarMatcher by thread count

    def start(self, host: torch.Tensor, states: list[GrammarState], rows: list[int], jobs: list[Job], count: int,
              background: bool = True) -> PendingFill:
        """Advances states[i] by its queued tokens and fills host row rows[i] from it (one batch call each;
        a row whose state ends there is set to all ones), then runs the jobs; count: the rows all of it fills.
        On the worker when background, threads > 0 and count >= min_rows; else here."""
        if not states and not jobs:
            return PendingFill(None)
        if self.pipe and not jobs:  # verify runs (jobs) keep the general path below
            return self._start_pipe(host, states, rows, count, background)
        if not background or self.threads <= 0 or count < self.min_rows:
            return PendingFill(_done(self._fill, host, states, rows, jobs))
        if self.accept_on_loop and states:  # the queued tokens here: the worker only fills
            try:
                states, rows = _advance(host, states, rows)
            except Exception as exc:  # reported by wait(), as the worker's errors are
                return PendingFill(_failed(exc))
            if not states and not jobs:
                return PendingFill(None)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lamina-grammar-fill")
        switch_s = None
        if self.switch_us is not None:
            switch_s = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_us * 1e-6)
        started = threading.Event() if self.wait_start else None
        future = self._pool.submit(self._fill, host, states, rows, jobs, started, not self.accept_on_loop)
        if started is not None:
            started.wait()  # set before the lock-releasing batch fill, or when the fill ends (an error too)
        return PendingFill(future, switch_s)

    def _start_pipe(self, host: torch.Tensor, states: list[GrammarState], rows: list[int], count: int,
                    background: bool) -> PendingFill:
        """start() by fill_pipe.py: the queued tokens in one batch accept (on the worker, or here with
        accept_on_loop or when filling here), then one batch fill; the step loop does not wait for the worker."""
        try:
            plan = split_pending(states, rows)
            for r in plan.ended:
                host[r].numpy().fill(ALL_ALLOWED)
            batch = self._batch_matcher(batch_threads(len(plan.states), self.threads))
            here = not background or self.threads <= 0 or count < self.min_rows
            if here or self.accept_on_loop:
                accept_batch(plan, host)
            if here:
                fill_batch(batch, plan, host)
                return PendingFill(None)
        except Exception as exc:  # reported by wait(), as the worker's errors are
            return PendingFill(_failed(exc))
        if not plan.states:
            return PendingFill(None)
        if self._pipe is None:
            self._pipe = PipeWorker()
        switch_s = None
        if self.switch_us is not None:
            switch_s = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_us * 1e-6)

        def run() -> None:
            accept_batch(plan, host)
            fill_batch(batch, plan, host)

        return PendingFill(self._pipe.submit(run), switch_s)

    def _batch_matcher(self, n: int):
        batch = self._batch.get(n)
        if batch is None:
            import xgrammar as xg

            batch = self._batch[n] = xg.BatchGrammarMatcher(n)
        return batch

    def _fill(self, host: torch.Tensor, states: list[GrammarState], rows: list[int], jobs: list[Job],
              started: threading.Event | None = None, advance: bool = True) -> None:
        try:
            if advance and states:
                states, rows = _advance(host, states, rows)
            self._fill_rows(host, states, rows, jobs, started)
        finally:
            if started is not None:
                started.set()

    def _fill_rows(self, host: torch.Tensor, states: list[GrammarState], rows: list[int], jobs: list[Job],
                   started: threading.Event | None) -> None:
        if states:
            batch = self._batch_matcher(batch_threads(len(states), self.threads))
            if started is not None:
                started.set()
            batch.batch_fill_next_token_bitmask([s.matcher for s in states], host, rows)  # whole rows written
        for job in jobs:
            job()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        self._batch.clear()


def _advance(host: torch.Tensor, states: list[GrammarState], rows: list[int]) -> tuple[list, list[int]]:
    """Gives the states their queued tokens; the rows of those that ended (a stop token or a rejected one
    came back) are set to all ones and left out of what is returned (states, rows) to fill."""
    advance_all(states)
    if not any(s.done for s in states):
        return states, rows
    keep = [i for i, s in enumerate(states) if not s.done]
    for i in set(range(len(states))).difference(keep):
        host[rows[i]].numpy().fill(ALL_ALLOWED)
    return [states[i] for i in keep], [rows[i] for i in keep]


def _failed(exc: Exception) -> Future:
    f: Future = Future()
    f.set_exception(exc)
    return f


def _done(fn: Callable, *args) -> Future:
    """fn(*args) run on this thread, as a done future: its error is kept for wait(), as the worker's is."""
    f: Future = Future()
    try:
        f.set_result(fn(*args))
    except Exception as exc:
        f.set_exception(exc)
    return f
