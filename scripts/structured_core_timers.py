"""The core side of scripts/structured_serve_cost.py: inside the spawned engine core process, wraps the engine's
phases in timers (nothing in lamina changes) and writes their totals, grouped by (constrained or not, sampled
rows), whenever the core goes idle; per request the constraint check, grammar hold/attach and compilation.
The driver (structured_serve_cost.py) spawns the core through timed_core_main and reads the totals."""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path


class _Timers:
    """Per-step phase totals, grouped by (constrained, sampled rows); per-request totals apart."""

    def __init__(self, path: str, sync: bool) -> None:
        self.path, self.sync = path, sync
        self.steps: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.requests: dict[str, float] = defaultdict(float)
        self.cur: dict[str, float] = defaultdict(float)
        self.key = None
        self.dirty = False

    def wrap(self, owner, name: str, phase: str, per_request: bool = False, sync: bool = False) -> None:
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            return
        timers = self

        def timed(*a, **k):
            if sync and timers.sync:
                _cuda_sync()
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if sync and timers.sync:
                    _cuda_sync()
                dt = time.perf_counter() - t
                if per_request:
                    timers.requests[phase + "_s"] += dt
                    timers.requests[phase + "_n"] += 1
                else:
                    timers.cur[phase] += dt
                    timers.cur[phase + "_n"] += 1

        setattr(owner, name, timed)

    def end_step(self, dt: float) -> None:
        key = self.key or "idle"
        agg = self.steps[key]
        agg["steps"] += 1
        agg["step"] += dt
        for k, v in self.cur.items():
            agg[k] += v
        self.cur.clear()
        self.key = None
        self.dirty = True

    def dump(self) -> None:
        if not self.dirty:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"steps": self.steps, "requests": self.requests}, f)
        os.replace(tmp, self.path)
        self.dirty = False


def _cuda_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _install(path: str, sync: bool) -> None:
    import xgrammar as xg

    from lamina.engine import core_proc, engine, runner, sampler
    from lamina.structured import bitmask, compiler, fill, manager, state

    t = _Timers(path, sync)
    eng = engine.LLMEngine
    t.wrap(runner.ModelRunner, "prepare", "prepare")
    t.wrap(runner.ModelRunner, "execute", "forward", sync=True)
    t.wrap(sampler.Sampler, "sample", "sample", sync=True)
    t.wrap(eng, "_resolve", "resolve")
    t.wrap(eng, "_admit_held", "admit")
    t.wrap(state.GrammarState, "accept", "accept")
    t.wrap(manager.StructuredOutputManager, "bitmask", "bitmask")
    # The overlapped fill (structured/fill.py): starting it on the step loop, and the step loop's wait for
    # it (with the host-to-device copies) before sampling; `fill` is the step's one batch fill (on the
    # filler's worker; single-row fills, fill_row, only in verify runs), so fill - fill_wait is the part of the
    # fill that overlapped the batch build and the forward.
    t.wrap(manager.StructuredOutputManager, "start_bitmask", "mask_start")
    t.wrap(getattr(manager, "PendingMask", None), "result", "mask_result")
    t.wrap(getattr(manager, "PendingFill", None), "wait", "fill_wait")
    # Inside mask_start: the filler's start (the hand-off, with the wait for the worker's start by default) and
    # the grammars taking their queued tokens (on the worker by default, on the loop with ACCEPT_ON_LOOP=1).
    t.wrap(getattr(fill, "MaskFiller", None), "start", "filler_start")
    t.wrap(fill, "advance_all", "accept_all")
    # The pipe (fill_pipe.py): its batch accept (on its worker, or on the loop) and its batch fill on raw handles
    # (not through xgrammar's wrapper, so "fill" is timed here instead), and the loop's split of the rows.
    t.wrap(fill, "accept_batch", "accept_all")
    t.wrap(fill, "fill_batch", "fill")
    t.wrap(fill, "split_pending", "split")
    t.wrap(bitmask.BitmaskBuffers, "to_device", "h2d")
    t.wrap(bitmask.BitmaskBuffers, "host", "host_buf")
    t.wrap(getattr(xg, "BatchGrammarMatcher", None), "batch_fill_next_token_bitmask", "fill")
    t.wrap(xg.GrammarMatcher, "fill_next_token_bitmask", "fill_row")
    for name in ("apply_bitmask", "masked_copy"):  # in place, or the device path's one out-of-place pass
        t.wrap(sampler, name, "apply")
    t.wrap(manager.StructuredOutputManager, "prepare", "check", per_request=True)
    t.wrap(manager.StructuredOutputManager, "hold", "hold", per_request=True)
    t.wrap(state.GrammarState, "__init__", "matcher_new", per_request=True)
    t.wrap(compiler.GrammarCompilerService, "_compile", "compile", per_request=True)

    constrains = manager.StructuredOutputManager.constrains

    def constrains_rec(rows):
        c = constrains(rows)
        t.key = f"{'schema' if c else 'plain'}:{len(rows)}"
        return c

    manager.StructuredOutputManager.constrains = staticmethod(constrains_rec)
    managers, originals = [], {}
    init = manager.StructuredOutputManager.__init__

    def init_rec(self, *a, **k):
        init(self, *a, **k)
        managers.append(self)

    manager.StructuredOutputManager.__init__ = init_rec
    control = path + ".variant"
    ws_base = compiler.whitespace_on_host()

    def apply_variant() -> None:  # the driver's choice for the next run (VARIANTS), on the first step after idle
        try:
            attrs = json.loads(Path(control).read_text())
        except (OSError, ValueError):
            return
        ws = bool(attrs.pop("ws_on_host", ws_base))
        if ws != compiler.whitespace_on_host():  # the grammars compile again (the switch's first requests wait)
            os.environ[compiler.ENV_WS_ON_HOST] = "1" if ws else "0"
            for m in managers:
                if m._compiler is not None:
                    m._compiler.close()
                    m._compiler = None
        for m in managers:
            f = m._filler
            base = originals.setdefault(id(f), {k: getattr(f, k, None) for k in (
                "threads", "min_rows", "wait_start", "accept_on_loop", "switch_us", "pipe")})
            for k, v in {**base, **attrs}.items():
                setattr(f, k, v)

    step = eng.step

    last = [None]

    def step_timed(self):
        s = time.perf_counter()
        if last[0] is not None and s - last[0] < 1.0:  # step start to step start, idle gaps left out
            t.cur["period"] += s - last[0]
        if last[0] is None or s - last[0] > 0.2:
            apply_variant()
        last[0] = s
        try:
            return step(self)
        finally:
            t.end_step(time.perf_counter() - s)

    eng.step = step_timed
    iterate = core_proc.CoreLoop.iterate

    def iterate_timed(self):
        s = time.perf_counter()
        try:
            return iterate(self)
        finally:
            t.cur["loop"] += time.perf_counter() - s  # lands in the next step's record
            if not self.core.has_work():
                t.dump()

    core_proc.CoreLoop.iterate = iterate_timed
    import gc

    gc_start = [0.0]

    def on_gc(phase, info):  # collector pauses inside the step loop
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            t.cur["gc"] += time.perf_counter() - gc_start[0]
            t.cur["gc_n"] += 1

    gc.callbacks.append(on_gc)


def timed_core_main(config, addrs, parent_pid, log_level, path, sync):
    _install(path, sync)
    from lamina.engine.core_proc import core_main

    core_main(config, addrs, parent_pid, log_level)
