"""Data parallelism behind one API server: N engine core processes, one CoreClient each, one router.

`DPClient` has the caller-facing interface of CoreClient (what the server uses: start/wait_ready/shutdown,
add_request, abort, abort_all, generate, is_running, num_in_flight, info, backend.kill), so the server's
code does not know how many replicas there are. Each replica is a whole engine core process (possibly rank
0 of its own tensor-parallel group); on CUDA replica i sees only GPUs i*tp .. i*tp+tp-1 (CUDA_VISIBLE_DEVICES
is set in its process before CUDA starts), so its ranks use cuda:0..tp-1 as they would alone.

Routing (dp_router.py): prefix-cache-aware within a load margin, else least loaded; the replica a request
went to is remembered, so its aborts go there. Replicas start in parallel (each spawns and loads at once;
wait_ready waits for all); one failing fails the start with its reason. Health: `is_running` is false as
soon as any replica has died (/health 503): its in-flight requests fail (its own client fails them), the
others keep serving. Metrics: one observer per replica feeds `ReplicaStats`, which sums the replicas' stats
(their running totals sum to running totals) into the server's metrics, plus per-replica series labelled
`replica`.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
from typing import Any

import msgspec
from prometheus_client import Counter, Gauge

from lamina.config import EngineConfig
from lamina.engine.core_client import CoreClient
from lamina.engine.core_proc import CoreProcess
from lamina.engine.dp_router import PrefixRouter
from lamina.engine.engine_stats import EngineStats
from lamina.engine.ipc import CoreInfo, IterationStats
from lamina.engine.streams import EngineDeadError, EngineObserver, RequestStream, StreamingClient
from lamina.sampling_params import SamplingParams

log = logging.getLogger("lamina")

_SUMMED = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "num_snapshot_hits",
           "num_prefix_queried_tokens", "num_step_failures", "num_spec_drafts", "num_spec_draft_tokens",
           "num_spec_accepted_tokens", "num_preemptions", "num_spec_paused", "num_spec_pauses")


def replica_gpus(index: int, tp: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES of replica `index` with `tp` ranks, out of what this process sees (`visible`:
    its own CUDA_VISIBLE_DEVICES, None for every GPU). Refuses (one line) a list too short for the replica."""
    want = range(index * tp, index * tp + tp)
    if visible is None or not visible.strip():
        return ",".join(str(g) for g in want)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if want[-1] >= len(ids):
        raise ValueError(f"data-parallel replica {index} needs GPUs {want[0]}..{want[-1]} of CUDA_VISIBLE_DEVICES="
                         f"{visible!r}, which lists {len(ids)}")
    return ",".join(ids[g] for g in want)


def check_replica_gpus(config: EngineConfig) -> None:
    """In a replica's process, after its CUDA_VISIBLE_DEVICES is set: a host with NVIDIA GPUs that shows this
    replica fewer than it needs is refused (else device 'auto' would quietly fall back to the CPU)."""
    if config.device == "cpu" or not os.path.exists("/dev/nvidiactl"):
        return
    import torch

    have = torch.cuda.device_count()
    if have < config.tensor_parallel_size:
        raise ValueError(f"this data-parallel replica needs {config.tensor_parallel_size} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}) and sees {have}: "
                         "--data-parallel-size x --tensor-parallel-size must not exceed the GPUs of this host")


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts and running totals summed (kv usage follows the sums)."""
    total = EngineStats(**{name: sum(getattr(s, name) for s in stats) for name in _SUMMED})
    per_pos = [s.spec_accepted_per_position or [] for s in stats]
    if any(per_pos):
        width = max(len(p) for p in per_pos)
        total.spec_accepted_per_position = [sum(p[j] for p in per_pos if j < len(p)) for j in range(width)]
    return total


class ReplicaStats:
    """Collects every replica's latest stats and feeds their sum to the server's observer (one lock: each
    replica's receiver thread reports on its own), plus per-replica gauges and counters when given the
    metrics' registry."""

    def __init__(self, num_replicas: int, observer: EngineObserver | None, registry=None,
                 model_name: str = "") -> None:
        self.observer = observer
        self._lock = threading.Lock()
        self._stats: list[EngineStats | None] = [None] * num_replicas
        self._model = model_name
        self.routed = self.running = self.up = self.prefix_routed = None
        if registry is not None:
            labels = ["model_name", "replica"]
            self.routed = Counter("lamina:dp_requests_routed", "Requests sent to each data-parallel replica.",
                                  labels, registry=registry)
            self.prefix_routed = Counter("lamina:dp_prefix_routed", "Requests sent to a replica for its recorded "
                                         "prompt prefix (not for its load).", labels, registry=registry)
            self.running = Gauge("lamina:dp_num_requests_running", "Requests in each replica's running batch.",
                                 labels, registry=registry)
            self.up = Gauge("lamina:dp_replica_up", "1 while the replica's engine core runs.", labels,
                            registry=registry)
            for i in range(num_replicas):
                for metric in (self.routed, self.prefix_routed, self.running, self.up):
                    metric.labels(model_name, str(i))

    def observer_for(self, index: int) -> EngineObserver:
        stats = self

        class _One:
            def on_iteration(self, it: IterationStats, s: EngineStats) -> None:
                stats.on_iteration(index, it, s)

        return _One()

    def on_iteration(self, index: int, it: IterationStats, stats: EngineStats) -> None:
        with self._lock:
            self._stats[index] = stats
            known = [s for s in self._stats if s is not None]
            if self.running is not None:
                self.running.labels(self._model, str(index)).set(stats.num_running)
            if self.observer is not None:
                self.observer.on_iteration(it, sum_stats(known))

    def on_route(self, index: int, by_prefix: bool) -> None:
        if self.routed is not None:
            self.routed.labels(self._model, str(index)).inc()
            if by_prefix:
                self.prefix_routed.labels(self._model, str(index)).inc()

    def watch(self, index: int, client: CoreClient) -> None:
        """dp_replica_up reads the replica's state whenever /metrics is rendered."""
        if self.up is not None:
            self.up.labels(self._model, str(index)).set_function(lambda: 1.0 if client.is_running else 0.0)


class _Backends:
    """What the server's signal handler reaches for (`backend.kill()`): every replica's process."""

    def __init__(self, clients: list[CoreClient]) -> None:
        self.clients = clients

    def kill(self) -> None:
        for c in self.clients:
            c.backend.kill()


class DPClient(StreamingClient):
    def __init__(self, clients: list[CoreClient], block_size: int, stats: ReplicaStats | None = None) -> None:
        self.clients = clients
        self.stats = stats
        self.router = PrefixRouter(len(clients), block_size)
        self.backend = _Backends(clients)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the router and the owner map (callers on any thread)
        self._owner: dict[str, int] = {}
        if stats is not None:
            for i, c in enumerate(clients):
                stats.watch(i, c)

    @classmethod
    def spawn(cls, config: EngineConfig, num_replicas: int, observer: EngineObserver | None = None,
              registry=None, model_name: str = "", wait: bool = True) -> DPClient:
        """Starts `num_replicas` core processes at once (each loading its model); with `wait`, returns once
        all are ready (else call wait_ready)."""
        if ":" in config.device:
            raise ValueError(f"--data-parallel-size places replica i on GPUs i*tp .. i*tp+tp-1; give --device "
                             f"cuda or auto, not {config.device}")
        stats = ReplicaStats(num_replicas, observer, registry, model_name)
        on_cuda = config.device != "cpu"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        clients = []
        for i in range(num_replicas):
            env = {"CUDA_VISIBLE_DEVICES": replica_gpus(i, config.tensor_parallel_size, visible)} if on_cuda else {}
            clients.append(CoreClient(CoreProcess(dataclasses.replace(config), env=env), stats.observer_for(i)))
        client = cls(clients, config.block_size, stats)
        client.start(wait=wait)
        return client

    # ---- lifecycle ------------------------------------------------------------------------------
    def set_tokenizer(self, tokenizer) -> None:
        for c in self.clients:
            c.set_tokenizer(tokenizer)  # each keeps a private copy (its own receiver thread decodes)

    def start(self, timeout: float | None = None, wait: bool = True) -> None:
        for c in self.clients:  # spawning returns at once: the replicas load in parallel
            c.start(wait=False)
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Blocks until every replica is ready; the first that failed stops all and raises RuntimeError
        naming it."""
        for i, c in enumerate(self.clients):
            try:
                c.wait_ready(timeout)
            except RuntimeError as e:
                self.shutdown(timeout=5)
                raise RuntimeError(f"data-parallel replica {i}: {e}") from None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops every replica (in parallel: each waits for its own core's Stopped)."""
        threads = [threading.Thread(target=c.shutdown, args=(timeout,), daemon=True) for c in self.clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 15)

    @property
    def info(self) -> CoreInfo | None:
        """Replica 0's (every replica loads the same model), with the block count of all of them."""
        first = self.clients[0].info
        if first is None:
            return None
        total = sum(c.info.num_total_blocks for c in self.clients if c.info is not None)
        return msgspec.structs.replace(first, num_total_blocks=total)

    @property
    def pids(self) -> list[int | None]:
        return [getattr(getattr(c.backend, "proc", None), "pid", None) for c in self.clients]

    @property
    def is_running(self) -> bool:
        """False once any replica is gone: the server reports unhealthy (the others still serve)."""
        return all(c.is_running for c in self.clients)

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.clients)

    @property
    def last_stats(self) -> EngineStats | None:
        known = [c.last_stats for c in self.clients if c.last_stats is not None]
        return sum_stats(known) if known else None

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    # ---- requests ---------------------------------------------------------------------------------
    def _route(self, request_id: str, prompt: Any) -> int:
        with self._lock:
            usable = [c.is_running for c in self.clients]
            if not any(usable):
                raise EngineDeadError("no data-parallel replica is running")
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt", ""))
            route = self.router.choose(prompt, [c.num_in_flight for c in self.clients], usable)
            self._owner[request_id] = route.replica
            if len(self._owner) > 4 * (self.num_in_flight + 256):  # drop the ids of finished requests
                self._owner = {r: i for r, i in self._owner.items() if self.clients[i].holds(r)}
        if self.stats is not None:
            self.stats.on_route(route.replica, route.matched_blocks > 0)
        return route.replica

    async def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams
                          ) -> RequestStream:
        """As CoreClient.add_request, on the replica the router picks."""
        replica = self._route(request_id, prompt)
        try:
            return await self.clients[replica].add_request(request_id, prompt, params)
        except BaseException:
            with self._lock:
                self._owner.pop(request_id, None)
            raise

    def abort(self, request_id: str) -> None:
        """To the replica holding the request (idempotent; unknown ids are ignored)."""
        with self._lock:
            replica = self._owner.pop(request_id, None)
        if replica is not None:
            self.clients[replica].abort(request_id)

    def abort_all(self) -> int:
        return sum(c.abort_all() for c in self.clients)

    def replica_of(self, request_id: str) -> int | None:
        with self._lock:
            return self._owner.get(request_id)
