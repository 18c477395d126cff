"""Tensor-parallel workers as Ray actors (`distributed_executor_backend="ray"`): the ranks of one model may
sit on several nodes of a Ray cluster.

Only how the workers start and where they are changes; what they run is workers.worker_main, and the
per-step broadcast, the weights and the pools are as with the mp backend. Rank 0 stays the engine (core)
process, which is the Ray driver: it joins the cluster this host is part of (`ray start --head` /
`ray start --address=...`; with none, ray.init starts a local one), reserves a placement group of one bundle
per rank (1 GPU + 1 CPU each on CUDA, 1 CPU otherwise; bundle 0 pinned to this node, for rank 0 itself;
PACK: fill a node before the next), starts ranks 1..N-1 as actors in bundles 1..N-1 and hands them its
address and a free port, where it hosts the torch.distributed store (context.connect).

GPUs: Ray is told not to set CUDA_VISIBLE_DEVICES for the actors (they see their node's GPUs, as rank 0
does), and each uses the GPU id Ray assigned to its bundle; a placeholder actor holds bundle 0's GPU, and
rank 0 makes that id its current device, so two ranks on one node never share a GPU.

Failure is as with mp: an actor's `run` call resolves only when its process ended, so a ready call in the
liveness check before each step (or after a failed collective) is a dead worker: ParallelFailure naming it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import sys
import threading
from typing import Any

import torch

from lamina.parallel.context import ParallelFailure, connect
from lamina.parallel.rank_group import RankGroup
from lamina.parallel.step_message import send_stop
from lamina.parallel.workers import COLLECTIVE_TIMEOUT, _free_port

log = logging.getLogger("lamina")

PLACEMENT_TIMEOUT = 60.0  # seconds the cluster gets to find room for every bundle
_NOSET = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'lamina[ray]'") from None
    return ray


def _init_keeping_signals(ray, **kwargs) -> None:
    """ray.init, then this process's SIGINT/SIGTERM handlers as they were: Ray installs its own (exit on
    SIGTERM), but the server's engine core must ignore both (its server decides when it stops)."""
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    ray.init(**kwargs)
    for sig, handler in previous.items():
        if handler is not None:
            signal.signal(sig, handler)


class _ErrorLine:
    """worker_main's error channel in an actor: the line goes to the actor's stderr (Ray forwards it to the
    driver's log); the driver sees the exit through the actor's `run` call."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def send(self, message: str) -> None:
        print(f"lamina tensor-parallel worker {self.rank}: {message}", file=sys.stderr, flush=True)


class RankActor:
    """One rank of the group (Ray makes it an actor class at start-up, so importing this needs no Ray)."""

    def gpu_ids(self) -> list[int]:
        import ray

        return [int(g) for g in ray.get_gpu_ids()]

    def run(self, rank: int, world: int, host: str, port: int, config: Any, log_level: int,
            on_cuda: bool) -> None:
        from lamina.parallel.workers import worker_main

        index = self.gpu_ids()[0] if on_cuda else None
        worker_main(rank, world, port, config, _ErrorLine(rank), log_level, host=host, device_index=index)


class RayTPGroup(RankGroup):
    """Rank 0's handle on its actors: the same interface as workers.TPGroup."""

    def __init__(self, config: Any, device: torch.device) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group

        super().__init__(config.tensor_parallel_size, device)
        self._ray = ray
        on_cuda = device.type == "cuda"
        env = {"env_vars": dict(_NOSET)} if on_cuda else None
        if not ray.is_initialized():
            _init_keeping_signals(ray, runtime_env=env, logging_level=logging.WARNING)
        unit = {"CPU": 1.0, "GPU": 1.0} if on_cuda else {"CPU": 1.0}
        host = ray.util.get_node_ip_address()
        bundles = [{**unit, f"node:{host}": 0.001}] + [dict(unit) for _ in range(self.world - 1)]
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT)
        except Exception:
            ray.util.remove_placement_group(self.pg)
            raise ValueError(f"the Ray cluster has no room for {self.world} bundles of {unit} (one per "
                             f"tensor-parallel rank; cluster: {ray.cluster_resources()})") from None
        self.actors: list[Any] = []
        self.holder = None
        try:
            self._start(config, device, host, unit, env)
        except BaseException:
            self._release()
            raise

    def _start(self, config: Any, device: torch.device, host: str, unit: dict, env: dict | None) -> None:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        on_cuda = "GPU" in unit
        actor_cls = ray.remote(RankActor)

        def place(index: int):
            return actor_cls.options(
                num_cpus=unit["CPU"], num_gpus=unit.get("GPU", 0), runtime_env=env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
            ).remote()

        self.holder = place(0) if on_cuda else None  # holds rank 0's GPU in Ray's books
        if self.holder is not None and device.index is None:
            torch.cuda.set_device(ray.get(self.holder.gpu_ids.remote())[0])
        self.actors = [place(r) for r in range(1, self.world)]
        port = _free_port()
        level = logging.getLogger("lamina").level
        self.runs = [a.run.remote(r, self.world, host, port, config, level, on_cuda)
                     for r, a in enumerate(self.actors, start=1)]
        self.ctx = dataclasses.replace(self._join(port, device, host),
                                       expert_parallel=getattr(config, "enable_expert_parallel", False))

    def _join(self, port: int, device: torch.device, host: str):
        """Rank 0's connect, watching the actors meanwhile: one that ends before joining (lamina missing on
        its node, a bad setting) fails the start with its reason instead of a wait for the store's timeout."""
        got: dict[str, Any] = {}

        def join() -> None:
            try:
                got["ctx"] = connect(0, self.world, port, device, COLLECTIVE_TIMEOUT, host)
            except BaseException as e:  # handed to the caller's thread
                got["error"] = e

        thread = threading.Thread(target=join, name="lamina-ray-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            ended = self._ended(0) if thread.is_alive() else []
            if ended:
                raise ParallelFailure(f"tensor-parallel worker {ended[0]} (Ray actor) ended before joining the "
                                      f"group: {self._reason(ended[0])}")
        if "error" in got:
            raise got["error"]
        return got["ctx"]

    def _reason(self, rank: int) -> str:
        """The last line of what ended rank's actor call."""
        try:
            self._ray.get(self.runs[rank - 1], timeout=5)
        except Exception as e:  # RayTaskError (the traceback's text) or RayActorError (its process died)
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            return lines[-1].strip() if lines else type(e).__name__
        return "it returned"

    def _ended(self, timeout: float) -> list[int]:
        """Ranks whose actor call has ended (the actor's process exited or died)."""
        ready, _ = self._ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout, fetch_local=False)
        return [self.runs.index(ref) + 1 for ref in ready]

    def _ended_worker(self) -> str | None:
        ended = self._ended(0)
        return f"tensor-parallel worker {ended[0]} (Ray actor) exited: {self._reason(ended[0])}" if ended else None

    def _await_end(self, timeout: float) -> None:
        self._ended(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tells the workers to stop (if they can still hear it), waits for them, frees the bundles."""
        if self.failure is None and not self._ended(0):
            with contextlib.suppress(Exception):
                send_stop(self.ctx, self.device)
        self._ended(timeout)
        self._release()

    def _release(self) -> None:
        for actor in self.actors + ([self.holder] if self.holder is not None else []):
            with contextlib.suppress(Exception):
                self._ray.kill(actor)
        with contextlib.suppress(Exception):
            self._ray.util.remove_placement_group(self.pg)
