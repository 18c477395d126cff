"""Tensor-parallel worker processes: rank 0 (inside the engine) starts ranks 1..N-1 and drives them.

Process layout: the engine core process is rank 0. It spawns N-1 workers (torch.multiprocessing's spawn
context: fresh interpreters, no inherited CUDA state); all N join one torch.distributed group (gloo on the
CPU, NCCL on CUDA; rank r uses cuda:r; context.connect), and every rank goes through the same start-up in
the same order: load its slice of the weights, lay out its state, agree on the KV block count (the smallest
any rank fits), allocate its pools. Then the workers loop: receive a step (lamina/parallel/step_message.py),
run the forward, repeat until told to stop. Rank 0 alone schedules and samples; its runner sends each step
before running its own forward. Workers hold no request state at all; a hybrid's state-pool copies made by
rank 0 outside a forward follow each step (parallel/state_ops.py).

Failure: a worker that dies closes its sockets, so rank 0's next collective raises; rank 0 also checks the
workers' liveness before each step. Either becomes ParallelFailure, which the engine does not retry: the step's
requests fail with its message and the engine stays failed (the server's core process exits and /health
turns 503). If rank 0 dies, the workers' collectives fail likewise and they exit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
from typing import Any

import torch

from lamina.parallel.context import ParallelFailure, connect
from lamina.parallel.rank_group import RankGroup
from lamina.parallel.state_ops import recv_state
from lamina.parallel.step_message import recv_step, send_stop

log = logging.getLogger("lamina")

# How long a collective may wait for a peer that is alive but silent (a crashed peer fails at once).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def check_devices(device: torch.device, world: int) -> None:
    """One line when the host has fewer GPUs than ranks (rank r runs on cuda:r)."""
    if device.type == "cuda" and device.index not in (None, 0):
        raise ValueError(f"--tensor-parallel-size {world} places rank r on cuda:r; give --device cuda, not {device}")
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {world} needs {world} GPUs, this host has "
                         f"{torch.cuda.device_count()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _children_allowed():
    """The server's engine core is a daemonic process (so the server's exit ends it), and multiprocessing
    refuses children to daemonic processes; its workers are daemonic too and end with it."""
    config = multiprocessing.current_process()._config
    had, daemon = "daemon" in config, config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        if had:
            config["daemon"] = daemon
        else:
            config.pop("daemon", None)


class TPGroup(RankGroup):
    """Rank 0's handle on its workers: start them, send each step, notice their death, stop them."""

    def __init__(self, config: Any, device: torch.device) -> None:
        super().__init__(config.tensor_parallel_size, device)
        port = _free_port()
        mp = multiprocessing.get_context("spawn")
        self.pipes, self.procs = [], []
        with _children_allowed():
            for rank in range(1, self.world):
                recv, send = mp.Pipe(duplex=False)
                proc = mp.Process(target=worker_main, name=f"lamina-tp{rank}", daemon=True,
                                  args=(rank, self.world, port, config, send, logging.getLogger("lamina").level))
                proc.start()
                send.close()
                self.pipes.append(recv)
                self.procs.append(proc)
        self.ctx = dataclasses.replace(connect(0, self.world, port, device, COLLECTIVE_TIMEOUT),
                                       expert_parallel=getattr(config, "enable_expert_parallel", False))

    def _worker_error(self, i: int) -> str:
        pipe = self.pipes[i]
        with contextlib.suppress(EOFError, OSError):
            if pipe.poll():
                return f": {pipe.recv()}"
        return ""

    def _ended_worker(self) -> str | None:
        for i, proc in enumerate(self.procs):
            if not proc.is_alive():
                return (f"tensor-parallel worker {i + 1} (pid {proc.pid}) exited with code {proc.exitcode}"
                        f"{self._worker_error(i)}")
        return None

    def _await_end(self, timeout: float) -> None:
        ended = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=timeout)
        for proc in self.procs:  # its sentinel closes a moment before it can be reaped
            if proc.sentinel in ended:
                proc.join(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tells the workers to stop (if they can still hear it) and waits for them."""
        if self.failure is None and all(p.is_alive() for p in self.procs):
            with contextlib.suppress(Exception):
                send_stop(self.ctx, self.device)
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
        for pipe in self.pipes:
            pipe.close()


def start_tensor_parallel(config: Any, device: torch.device) -> TPGroup | None:
    """Checks the settings (one line on a bad one) and starts the workers; None for tensor_parallel_size 1."""
    world = getattr(config, "tensor_parallel_size", 1)
    if world == 1:
        return None
    from lamina.models.loader import read_config, resolve_source
    from lamina.parallel.expert_parallel import check_ep_config
    from lamina.parallel.tp_plan import check_tp_config, check_tp_engine

    check_tp_engine(config, world)
    on_ray = getattr(config, "distributed_executor_backend", "mp") == "ray"
    if not on_ray:  # Ray places the ranks on the cluster's GPUs, not this host's alone
        check_devices(device, world)
    cfg = read_config(resolve_source(config.model))[0]
    check_tp_config(cfg, world)
    check_ep_config(cfg, world, getattr(config, "enable_expert_parallel", False), warn=True)
    if on_ray:
        from lamina.parallel.ray_workers import RayTPGroup

        return RayTPGroup(config, device)
    return TPGroup(config, device)


def worker_main(rank: int, world: int, port: int, config: Any, errors, log_level: int, host: str = "127.0.0.1",
                device_index: int | None = None) -> None:
    """A worker's whole life: join the group, build its slice of the model and pools, run the steps.
    host: rank 0's address; device_index: its GPU when not cuda:rank (a Ray actor's assigned one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when the workers stop
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lamina").setLevel(log_level)
    from lamina.engine.build import build_graphs, build_pools
    from lamina.engine.memory import resolve_device, resolve_dtype
    from lamina.engine.runner import ModelRunner
    from lamina.models.loader import load_model, read_config, resolve_source

    try:
        device = rank_device(resolve_device(config.device), rank if device_index is None else device_index)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ctx = dataclasses.replace(connect(rank, world, port, device, COLLECTIVE_TIMEOUT, host),
                                  expert_parallel=getattr(config, "enable_expert_parallel", False))
        dtype = resolve_dtype(config.dtype, device)
        source = resolve_source(config.model)  # no tokenizer: a worker only runs forwards
        model_config, reader = read_config(source)
        max_pos = max(model_config.max_position_embeddings, config.max_model_len or 0)
        model = load_model(source, model_config, reader, dtype, device, max_pos, False, config.quantization,
                           keep_quantized=not config.dequantize_gguf, parallel=ctx)
        pools = build_pools(config, model, model_config, dtype, device, parallel=ctx)
        runner = ModelRunner(model, config.block_size, device)
        # The same graphs as rank 0, captured with it (each capture runs the model's collectives).
        runner.graphs = build_graphs(config, model, pools.max_model_len, pools.state_pool, device, strict=True)
        with torch.inference_mode():
            while (batch := recv_step(ctx, device, config.block_size, runner._ref_windows)) is not None:
                if pools.state_pool is not None:  # rank 0 sends its state part (TPGroup.attach_state)
                    batch = recv_state(ctx, device, batch, pools.state_pool, pools.snapshots)
                runner.execute(batch)
    except BaseException as e:  # tell rank 0 why (it sees the exit), then go
        log.error("tensor-parallel worker %d failed: %s", rank, e, exc_info=not isinstance(e, ParallelFailure))
        with contextlib.suppress(Exception):
            errors.send(f"{type(e).__name__}: {e}")
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)  # skip the interpreter's teardown of torch and the model
