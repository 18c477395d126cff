"""The engine core's loop over ZeroMQ, and the process that runs it next to the API server.

Loop: block while idle; otherwise drain every message waiting on the input channel (so all adds and aborts
that arrived during a step join the next one), answer the adds with one Verdicts message, run one step, and
send everything that step (and the aborts) produced as one StepOutputs message. The core never waits on the
server: sends are queued by ZeroMQ's I/O thread.

Process: `CoreProcess` spawns `core_main` with multiprocessing's 'spawn' context (a fresh interpreter: no
CUDA state or locks inherited from the server, which must never touch CUDA itself). The core ignores SIGINT
and SIGTERM (a terminal's Ctrl-C reaches the whole process group; the server decides when the core stops,
by a Shutdown message) and exits by itself if its parent goes away. A tensor-parallel group would sit behind
one core the same way: the core process owns the scheduler and drives its ranks; the channels stay as they are.
"""
from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from lamina.config import EngineConfig
from lamina.engine.core import EngineCore
from lamina.engine.deltas import DeltaEncoder
from lamina.engine.ipc import (
    Abort,
    Add,
    Addresses,
    Codec,
    CoreFailed,
    CoreInfo,
    IterationStats,
    Ready,
    Shutdown,
    StepOutputs,
    Stopped,
    StopSamples,
    Verdict,
    Verdicts,
)

log = logging.getLogger("lamina")

_IDLE_POLL_MS = 1000  # while idle the loop wakes this often, only to notice a parent that is gone
_SEND_TIMEOUT_MS = 1000
EXIT_GRACE = 3.0  # seconds a core that has answered Stopped gets to exit before it is killed


class CoreLoop:
    """Serves one EngineCore on two connected sockets until a Shutdown message or `alive()` turns false."""

    def __init__(self, core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket,
                 alive: Callable[[], bool] = lambda: True) -> None:
        self.core, self.inbox, self.outbox, self.alive = core, inbox, outbox, alive
        self.codec = Codec()
        self.deltas = DeltaEncoder()
        self.step_index = 0

    def run(self) -> None:
        self._send(StepOutputs(0, [], IterationStats(), self.core.stats()))  # gauges before the first request
        while self.alive():
            if not self.core.has_work() and not self.inbox.poll(_IDLE_POLL_MS):
                continue  # block when idle: a polling loop would steal a core from the model
            if not self.iterate():
                return

    def iterate(self) -> bool:
        """One drain + step; False once a Shutdown message was handled."""
        frames = self._drain()
        it = IterationStats()
        outs, verdicts = [], []
        for frame in frames:
            try:
                msg = self.codec.to_core.decode(frame)
            except msgspec.DecodeError:
                log.exception("engine core: undecodable message dropped")
                continue
            if isinstance(msg, Add):
                verdicts.append(self._add(msg))
                it.num_added += verdicts[-1].error is None
            elif isinstance(msg, Abort):
                outs += self.core.abort(msg.request_ids)
            elif isinstance(msg, StopSamples):
                outs += self.core.stop_samples(msg.items, it)
            elif isinstance(msg, Shutdown):
                outs += self.core.fail_all("the engine is shutting down")
                self._send(StepOutputs(self.step_index, [self.deltas.encode(o) for o in outs], it, self.core.stats()))
                self._send(Stopped())
                return False
        if verdicts:  # before the step: a request with many prompts must not wait one step per prompt
            self._send(Verdicts(verdicts))
        stepped = self.core.has_work()
        if stepped:
            self.step_index += 1
            outs += self.core.step(it)
        if frames or stepped:
            self._send(StepOutputs(self.step_index, [self.deltas.encode(o) for o in outs], it, self.core.stats()))
        return True

    def _add(self, msg: Add) -> Verdict:
        try:
            self.core.add(msg.request_id, msg.prompt, msg.params)
        except ValueError as e:
            return Verdict(msg.request_id, str(e), True)
        except Exception as e:  # not the caller's fault: a 500, and the loop goes on
            log.exception("engine core: add of %s failed", msg.request_id)
            return Verdict(msg.request_id, f"{type(e).__name__}: {e}", False)
        return Verdict(msg.request_id, None, False)

    def _drain(self) -> list[bytes]:
        frames = []
        while True:
            try:
                frames.append(self.inbox.recv(zmq.NOBLOCK, copy=True))
            except zmq.Again:
                return frames

    def _send(self, msg) -> None:
        data = self.codec.encode(msg)
        while True:
            try:
                self.outbox.send(data, copy=False)
                return
            except zmq.Again:  # the server is not reading (backpressure), or gone
                if not self.alive():
                    raise SystemExit(0) from None


def connect(ctx: zmq.Context, addrs: Addresses) -> tuple[zmq.Socket, zmq.Socket]:
    """The core's ends of the two channels."""
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(addrs.to_core)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
    outbox.setsockopt(zmq.LINGER, 5000)  # the last outputs reach the server before the process exits
    outbox.connect(addrs.from_core)
    return inbox, outbox


def core_info(engine, startup_seconds: float) -> CoreInfo:
    return CoreInfo(engine.config.model, engine.max_model_len, engine.model_config.vocab_size,
                    engine.stats().num_total_blocks, os.getpid(), startup_seconds)


def core_main(config: EngineConfig, addrs: Addresses, parent_pid: int, log_level: int,
              env: dict[str, str] | None = None) -> None:
    """Entry point of the core process: load the engine, say Ready (or why not), serve until told to stop.
    `env`: variables set before anything starts CUDA (a data-parallel replica's CUDA_VISIBLE_DEVICES)."""
    os.environ.update(env or {})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lamina").setLevel(log_level)
    import torch
    from tqdm import tqdm

    from lamina.engine.engine import LLMEngine

    # tqdm's default lock is a multiprocessing one, made by the first bar (the weight loader's); this process
    # ends through os._exit, so the resource tracker would report it as a leaked semaphore at shutdown.
    tqdm.set_lock(threading.RLock())

    ctx = zmq.Context()
    inbox, outbox = connect(ctx, addrs)
    codec = Codec()

    def parent_alive() -> bool:
        return os.getppid() == parent_pid

    t0 = time.monotonic()
    try:
        if env:
            from lamina.engine.dp_client import check_replica_gpus

            check_replica_gpus(config)
        engine = LLMEngine(config, progress=False)
    except BaseException as e:  # the server reports it and exits; no traceback for a config error
        log.debug("engine core start-up failed", exc_info=True)
        outbox.send(codec.encode(CoreFailed(f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e))))
        inbox.close(0)
        outbox.close()
        ctx.term()
        sys.exit(1)
    gc.collect()
    gc.freeze()  # the engine's start-up objects stay for good: keep them out of every later collection
    outbox.send(codec.encode(Ready(core_info(engine, time.monotonic() - t0))))
    try:
        with torch.inference_mode():
            CoreLoop(EngineCore(engine), inbox, outbox, parent_alive).run()
        t_end = time.monotonic()
        log.debug("engine core: loop ended; closing its channels")
    except BaseException as e:  # a bug in the loop: tell the server at once rather than leave it waiting
        log.exception("the engine core loop died")
        outbox.send(codec.encode(CoreFailed(f"the engine core loop died: {type(e).__name__}: {e}")))
        raise
    finally:
        inbox.close(0)
        outbox.close()
        ctx.term()  # after the last outputs went out (linger)
    # Every lease is back and the server has everything: skip the interpreter's teardown of torch and the
    # model (seconds on a loaded CPU), which would only delay the server's exit. What is left is the
    # driver's teardown of the device context at process exit (CoreProcess.stop bounds the wait for it).
    log.debug("engine core: channels closed in %.2f s; exiting", time.monotonic() - t_end)
    logging.shutdown()
    os._exit(0)


class CoreProcess:
    """The server's handle on a spawned core process."""

    def __init__(self, config: EngineConfig, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.env = env or {}
        self.proc: multiprocessing.process.BaseProcess | None = None

    def start(self, addrs: Addresses) -> None:
        mp = multiprocessing.get_context("spawn")
        level = logging.getLogger("lamina").getEffectiveLevel()  # the CLI sets lamina's own level
        # daemon: if the server exits without stopping the core, multiprocessing's exit hook still ends it.
        self.proc = mp.Process(target=core_main, args=(self.config, addrs, os.getpid(), level, self.env),
                               name="lamina-core", daemon=True)
        self.proc.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    @property
    def sentinel(self) -> int | None:
        """A file descriptor that turns readable when the process exits (select/poll-able)."""
        return self.proc.sentinel if self.proc is not None else None

    def describe_exit(self) -> str:
        code = self.proc.exitcode if self.proc is not None else None
        if code is not None and code < 0:
            return f"the engine core process died (signal {-code})"
        return f"the engine core process exited (status {code})"

    def stop(self, timeout: float, stopped: bool = False) -> None:
        """Waits for the process to end after a Shutdown message; kills it past the timeout. With `stopped`
        (the core answered Stopped: leases returned, last outputs sent) only the exit itself is left, which
        on a GPU includes the driver tearing down the device context: that gets EXIT_GRACE seconds, then
        the process is killed (nothing of it is in use any more)."""
        if self.proc is None:
            return
        if stopped:
            self.proc.join(EXIT_GRACE)
            if self.proc.is_alive():
                log.info("the engine core stopped but its process had not exited after %.0f s; killing it",
                         EXIT_GRACE)
                self.proc.kill()
                self.proc.join(5)
            return
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("the engine core did not stop in %.0f s; killing it", timeout)
            self.proc.kill()
            self.proc.join(5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
