"""`lamina bench serve --num-clients N`: N client processes share one run, so the client is not the limit.

The requests are dealt round-robin to the clients, the concurrency cap and the arrival rate divided among
them (a sum of Poisson streams is a Poisson stream at the summed rate), and the warm-ups too. Every client
warms up, then waits at a barrier, so all start together; the merged run lasts from the first start to the
last finish (wall-clock times, comparable across processes of one host), and every per-request figure is
summarized over all clients together. Each client's CPU time over the run is reported as a fraction of the
run: a client near 1.0 was busy all the time, and the figures may be the client's.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass

from lamina.bench.serve_client import BenchRequest, RequestResult, Target
from lamina.bench.serve_stats import RunSummary, summarize


@dataclass
class Share:
    """One client's part of a run."""
    reqs: list[BenchRequest]
    concurrency: int | None
    rate: float
    warmups: int
    seed: int


def split(reqs: list[BenchRequest], concurrency: int | None, rate: float, warmups: int, seed: int,
          num_clients: int) -> list[Share]:
    """Deals the run to at most num_clients clients: never more clients than requests or than the cap allows
    (each gets a cap of at least one); the caps sum to the cap, the rates to the rate."""
    n = max(1, min(num_clients, len(reqs), concurrency or num_clients))
    shares = []
    for i in range(n):
        cap = None if concurrency is None else concurrency // n + (i < concurrency % n)
        shares.append(Share(reqs[i::n], cap, rate / n, warmups // n + (i < warmups % n), seed * 1000 + i))
    return shares


async def _client_run(target: Target, share: Share, timeout: float, barrier, wait_s: float):
    from lamina.bench.serve import drive, http_client, warm_up

    async with http_client(share.concurrency or len(share.reqs), timeout) as client:
        await warm_up(client, target, share.reqs, share.warmups)
        barrier.wait(wait_s)  # blocking on purpose: nothing else runs in this loop yet
        t0, cpu0 = time.time(), time.process_time()
        results = await drive(client, target, share.reqs, share.concurrency, share.rate, share.seed)
        return results, t0, time.time(), time.process_time() - cpu0


def _client_main(index: int, target: Target, share: Share, timeout: float, barrier, out, wait_s: float) -> None:
    """A client process: runs its share and puts (index, results, start, end, cpu seconds) or (index, error)."""
    try:
        out.put((index, *asyncio.run(_client_run(target, share, timeout, barrier, wait_s))))
    except BaseException as e:  # the parent must hear of any failure, or it waits for this client
        barrier.abort()
        out.put((index, f"{type(e).__name__}: {e}"))


def run_multi(target: Target, reqs: list[BenchRequest], concurrency: int | None, rate: float, seed: int,
              timeout: float, num_clients: int, warmups: int = 0) -> RunSummary:
    """One run split over client processes (see the module docstring); summarized as one."""
    shares = split(reqs, concurrency, rate, warmups, seed, num_clients)
    ctx = mp.get_context("spawn")  # a fresh interpreter per client: no inherited event loop or sockets
    barrier, out = ctx.Barrier(len(shares) + 1), ctx.Queue()
    wait_s = timeout + 120.0  # warm-ups and process start-up
    procs = [ctx.Process(target=_client_main, args=(i, target, sh, timeout, barrier, out, wait_s), daemon=True)
             for i, sh in enumerate(shares)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    try:
        barrier.wait(wait_s)
    except threading.BrokenBarrierError:
        pass  # a client failed before the start: its message is in the queue
    while len(got) < len(shares):
        try:
            item = out.get(timeout=1.0)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                missing = sorted(set(range(len(shares))) - set(got))
                raise RuntimeError(f"client processes {missing} exited without a result") from None
            continue
        if len(item) == 2:
            for p in procs:
                p.terminate()
            raise RuntimeError(f"client process {item[0]} failed: {item[1]}")
        got[item[0]] = item[1:]
    for p in procs:
        p.join()
    results: list[RequestResult] = [r for i in range(len(shares)) for r in got[i][0]]
    start, end = min(g[1] for g in got.values()), max(g[2] for g in got.values())
    duration = end - start
    summary = summarize(results, duration, concurrency, rate)
    summary.num_clients = len(shares)
    summary.client_cpu_frac = [got[i][3] / duration for i in range(len(shares))]
    return summary
