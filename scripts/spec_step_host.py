#!/usr/bin/env python3
"""Host time of a speculative (verify) step outside the model, on the CPU: random:tiny-llama, forced replay
acceptance p (bench-only proposer, K = 3, gate off), B concurrent greedy sequences. The forward and the sampler
are timed apart and subtracted, so what is left is the host work a GPU step cannot overlap when a verify step is
read back before the next one is built (propose, schedule, prepare, accept, read-back, outputs).

Per verify step: host us by phase (median over steps), critical_us (the sum of the phases that ran between a verify
step's read-back and the next forward's launch in the tree this script was written for: read-back, gates,
propose, schedule, prepare, outputs), gap_us (measured, not summed: from the start of the draws' read-back of
the step before a verify step to that verify step's forward call, minus the forward/sampler/CPU-only attention
plan time in between: what a GPU waits for, whatever order the engine runs its phases in, the step loop's
own return and the LLM loop's output handling included), and with --ops the torch ops dispatched outside the
forward and the sampler. --stream returns every step's outputs as a server's engine does. A before/after
pair: run it with PYTHONPATH on each tree in turn, interleaved.

    python scripts/spec_step_host.py [--batch 1,64] [--p 0.8] [--output-len 48] [--stream]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CRITICAL = ("_resolve", "after_step", "_output", "_admit_held", "propose", "schedule", "prepare")


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.n += 1
        return func(*args, **(kwargs or {}))


def run(batch: int, p: float, output_len: int, count_ops: bool, stream: bool = False) -> dict:
    from lamina import LLM, SamplingParams
    from lamina.engine.runner import ModelRunner
    from lamina.engine.sampler import Sampler
    from lamina.spec.config import parse_speculative_config

    spec_cfg = parse_speculative_config({"method": "replay", "num_speculative_tokens": 3, "acceptance_prob": p,
                                         "forced": True, "min_acceptance_rate": 0}, bench=True)
    llm = LLM(model="random:tiny-llama", device="cpu", dtype="float32", speculative_config=spec_cfg,
              async_scheduling=True, max_num_seqs=max(batch, 1), max_num_batched_tokens=2048, progress=False,
              num_kv_blocks=64 * max(batch, 4))
    eng = llm.engine
    if stream:  # every step's outputs, as a server's engine returns them
        llm.core.engine.stream_outputs = True
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(32)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    spec = eng.spec
    spec_saved, eng.spec = eng.spec, None
    ref = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
    eng.spec = spec_saved
    spec.proposer.reference.update({tuple(q): list(o.outputs[0].token_ids) for q, o in zip(prompts, ref)})

    inside = [0.0, 0.0]  # seconds in the forward and the sampler: this step, and since the start
    counter = _OpCount() if count_ops else None
    orig_exec, orig_sample = ModelRunner.execute, Sampler.sample

    # Python and builtin calls per phase (the outermost phase running; none inside the forward, the sampler or
    # the CPU-only attention plan): a count that does not move with the machine's load, unlike the timings.
    stack: list[str] = []
    calls: dict[str, int] = {}

    def count_calls(frame, event, arg):
        if event in ("call", "c_call") and stack and stack[-1] != "inside":
            calls[stack[0]] = calls.get(stack[0], 0) + 1

    # gap: read-back start of a step -> the next forward call, inside time taken out (see the docstring)
    read_at: list[float] = []  # [perf_counter, inside[1]] at the last read-back's start
    gaps: list[tuple[int, float]] = []  # (tokens of the step launched, gap seconds)
    from lamina.engine.sampler import SampleTensors
    orig_finish = SampleTensors.finish_copy

    def finish_copy(self, started):
        read_at[:] = [time.perf_counter(), inside[1]]
        return orig_finish(self, started)
    SampleTensors.finish_copy = finish_copy

    def timed(fn, launch=False):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            if launch and read_at:
                gaps.append((int(a[1].input_ids.shape[0]), t - read_at[0] - (inside[1] - read_at[1])))
                read_at.clear()
            stack.append("inside")
            if counter is not None:
                counter.paused += 1
            try:
                return fn(*a, **kw)
            finally:
                stack.pop()
                if counter is not None:
                    counter.paused -= 1
                dt = time.perf_counter() - t
                inside[0] += dt
                inside[1] += dt
        return wrapper
    ModelRunner.execute, Sampler.sample = timed(orig_exec, launch=True), timed(orig_sample)
    # the torch reference attention's per-step plan runs on the CPU only (CUDA: Triton kernels, no plan)
    import lamina.engine.runner as runner_mod
    orig_plan = runner_mod.plan_attention
    runner_mod.plan_attention = timed(orig_plan)
    phases: dict[str, float] = {}

    def phase(obj, name):
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t, before = time.perf_counter(), inside[0]
            stack.append(name)
            try:
                return fn(*a, **kw)
            finally:
                stack.pop()
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t - (inside[0] - before)
        setattr(obj, name, wrapper)
    for obj, name in [(eng, "_resolve"), (eng, "_commit"), (eng.scheduler, "schedule"), (eng.runner, "prepare"),
                      (spec, "propose"), (spec, "after_step"), (eng, "_output"), (eng, "_admit_held"),
                      (eng.sampler, "arrays"), (eng.runner.staging, "ship"), (eng.runner.tables, "update"),
                      (eng.runner, "ship_sampling")]:
        if hasattr(obj, name):  # (ship_sampling: not in older trees, run with --compare)
            phase(obj, name)
    rows = []
    step = eng.step

    def probe():
        inside[0] = 0.0
        phases.clear()
        calls.clear()
        sys.setprofile(count_calls)
        n0 = counter.n if counter is not None else 0
        t = time.perf_counter()
        try:
            out = step()
        finally:
            sys.setprofile(None)
        wall = time.perf_counter() - t
        sched = eng.scheduler.num_scheduled_tokens
        rows.append({"host_us": 1e6 * (wall - inside[0]), "tokens": sched,
                     "ops": (counter.n - n0) if counter is not None else None,
                     "phases": {k: 1e6 * v for k, v in phases.items()}, "calls": dict(calls)})
        return out
    try:
        eng.step = probe
        for _ in range(2):  # warm-up pass, then the measured one
            rows.clear()
            gaps.clear()
            if counter is not None:
                with counter:
                    llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
            else:
                llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
    finally:
        ModelRunner.execute, Sampler.sample = orig_exec, orig_sample
        SampleTensors.finish_copy = orig_finish
        runner_mod.plan_attention = orig_plan
    verify = [r for r in rows if r["tokens"] > batch and r["tokens"] <= 4 * batch]  # decode + drafts, no prompt
    res = {"batch": batch, "p": p, "verify_steps": len(verify),
           "host_us_median": round(statistics.median(r["host_us"] for r in verify), 1) if verify else None}
    if verify:
        names = sorted({k for r in verify for k in r["phases"]})
        res["phase_us"] = {k: round(statistics.median(r["phases"].get(k, 0.0) for r in verify), 1) for k in names}
        # Before the next forward's launch, after the verify step's read-back waits: what a GPU cannot overlap.
        res["calls"] = {k: statistics.median(r["calls"].get(k, 0) for r in verify)
                        for k in sorted({k for r in verify for k in r["calls"]})}
        res["critical_calls"] = statistics.median(sum(r["calls"].get(k, 0) for k in CRITICAL) for r in verify)
        res["critical_us"] = round(statistics.median(sum(r["phases"].get(k, 0.0) for k in CRITICAL)
                                                     for r in verify), 1)
    vgaps = [g for n, g in gaps if batch < n <= 4 * batch]  # verify launches (the step before is read back first)
    if vgaps:
        res["gap_us"] = round(1e6 * statistics.median(vgaps), 1)
    if count_ops and verify:
        res["ops_median"] = statistics.median(r["ops"] for r in verify)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--p", type=float, default=0.8)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ops", action="store_true", help="count torch ops outside the forward and the sampler")
    ap.add_argument("--stream", action="store_true", help="outputs every step (a server's engine), not only finished")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for _ in range(args.repeats):
        for b in (int(x) for x in args.batch.split(",")):
            print(json.dumps(run(b, args.p, args.output_len, args.ops, args.stream)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
