"""Filling a step's token bitmask on a few worker threads, so the fill can run while the calling thread builds
the step and runs (or launches) its forward.

xgrammar's single-matcher fill releases the interpreter lock while it works; its batch fill
(BatchGrammarMatcher, 0.2.9) holds it for the whole call (measured: another Python thread made no progress
during a 4 ms batch fill of 256 rows), so it could not overlap the Python that builds the step, and its
own threads were the suspects for the H200 core process's 99.6 s of CPU in an 8 s run (BENCHMARKS.md). So
the rows are split into a few chunks, each filled row by row on a plain thread pool whose idle threads
sleep.

Threads: LAMINA_GRAMMAR_FILL_THREADS (default min(8, usable cores // 2), at least 1); 0 fills on the
calling thread only (no overlap). A chunk has at least ROWS_PER_THREAD rows; fewer rows than that are
filled on the calling thread at once (the hand-off costs more than it hides).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

ROWS_PER_THREAD = 8  # ~15-40 us a row: a smaller chunk costs more in hand-off than it saves
ENV_THREADS = "LAMINA_GRAMMAR_FILL_THREADS"


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


Job = Callable[[], None]  # fills some rows of the host bitmask; jobs touch disjoint rows and matchers


def chunk_jobs(jobs: list[Job], threads: int) -> list[list[Job]]:
    """jobs split into at most `threads` consecutive chunks of at least ROWS_PER_THREAD jobs (one chunk when
    threads <= 1 or there are few jobs)."""
    if not jobs:
        return []
    n = max(1, min(threads, len(jobs) // ROWS_PER_THREAD))
    size, extra = divmod(len(jobs), n)
    out, i = [], 0
    for c in range(n):
        k = size + (c < extra)
        out.append(jobs[i:i + k])
        i += k
    return out


def _run(chunk: list[Job]) -> None:
    for job in chunk:
        job()


class PendingFill:
    """Fill jobs started on the filler's threads (or already done); wait() returns once all have run and
    re-raises the first error."""

    def __init__(self, futures: list[Future]) -> None:
        self._futures = futures

    def wait(self) -> None:
        error = None
        for f in self._futures:  # every one is waited for, so no job still writes once this returns
            exc = f.exception()
            if exc is not None and error is None:
                error = exc
        self._futures = []
        if error is not None:
            raise error


def _run_here(chunk: list[Job]) -> Future:
    """The chunk run on this thread, as a done future: its error is kept for wait(), as a worker's is."""
    f: Future = Future()
    try:
        f.set_result(_run(chunk))
    except Exception as exc:
        f.set_exception(exc)
    return f


class MaskFiller:
    """Runs a step's fill jobs on `threads` worker threads (made on the first background fill); not
    thread-safe: one caller, one fill at a time (the caller waits for a fill before starting the next)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = default_fill_threads() if threads is None else threads
        self._pool: ThreadPoolExecutor | None = None

    def start(self, jobs: list[Job], background: bool = True) -> PendingFill:
        """Starts the jobs: on the worker threads when background (and threads > 0), else on this thread
        across the workers for many rows; right here for few (fewer than ROWS_PER_THREAD in the background,
        2 x that when the caller waits at once): no hand-off for what one thread does quickly."""
        if not jobs:
            return PendingFill([])
        # Few rows are filled right here, even for a background fill: handing one row to a thread cost the
        # step loop ~0.35 ms on the loaded 2-core machine (BENCHMARKS.md), more than the row's fill.
        if self.threads <= 0 or len(jobs) < (ROWS_PER_THREAD if background else 2 * ROWS_PER_THREAD):
            return PendingFill([_run_here(jobs)])
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lamina-grammar-fill")
        chunks = chunk_jobs(jobs, self.threads + (0 if background else 1))
        futures = [self._pool.submit(_run, c) for c in (chunks if background else chunks[1:])]
        if not background:  # the caller waits anyway: it fills a share itself
            return PendingFill([_run_here(chunks[0]), *futures])
        return PendingFill(futures)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
