"""The per-step host path of structured output at N constrained rows, without a model (CPU, ~1 minute):
each step reads the tokens back into the grammars (GrammarState.accept, as StepReadback._accept does), starts
the bitmask (StructuredOutputManager.start_bitmask: the fill goes to the filler's worker), runs --busy-us of
pure Python on the step loop's thread (standing in for the batch build and the forward's launch, which hold
the interpreter lock), then waits for the mask (PendingMask.result). Tokens: a random allowed token per row
(seeded), drawn from the step's own mask outside the timed phases.

Per phase, us per step on the step loop's thread (median over steps): accept, mask_start, busy, mask_result
(the wait for the fill); `extra` = step - busy is what structured output puts on the step's critical path.

  python scripts/structured_host_step.py [--rows 64] [--steps 200] [--busy-us 1500] [--tokenizer DIR]
      [--release-us 20] [--pipe] [--accept-on-loop] [--no-wait-start] [--switch-us 200]
      [--fill-switch-us 200] [--min-rows 1] [--work]

--pipe: structured/fill_pipe.py (LAMINA_GRAMMAR_FILL_PIPE); --accept-on-loop, --no-wait-start and
--fill-switch-us set the filler's other knobs (structured/fill.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

VOCAB = 151936


def busy(us: float, release_us: float = 0.0) -> None:
    """Pure Python for `us` microseconds: holds the interpreter lock as the batch build does. release_us > 0:
    a small torch op every release_us microseconds, which lets the lock go for its duration as the batch
    build's and the forward's torch calls do (torch's bindings release it around each op)."""
    end = time.perf_counter() + us * 1e-6
    nxt = time.perf_counter() + release_us * 1e-6 if release_us > 0 else float("inf")
    x, t = 0, _SMALL
    while (now := time.perf_counter()) < end:
        for i in range(50):
            x += i
        if now >= nxt:
            t = t.add(1)
            nxt = now + release_us * 1e-6


_SMALL = torch.zeros(4)


def busy_work(chunks: int, release_every: int = 0) -> None:
    """A fixed amount of Python (chunks of 50 additions; a small torch op every release_every chunks): time
    the worker takes the interpreter lock from the step loop lengthens it, as it lengthens the batch build."""
    x, t = 0, _SMALL
    for c in range(chunks):
        for i in range(50):
            x += i
        if release_every and c % release_every == 0:
            t = t.add(1)


def calibrate(us: float, release_us: float) -> tuple[int, int]:
    """(chunks, release_every) for busy_work to take about us (and a torch op every release_us) alone."""
    n = 2000
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        busy_work(n)
        best = min(best, time.perf_counter() - t)
    per_us = n / (best * 1e6)
    return max(1, round(us * per_us)), round(release_us * per_us) if release_us > 0 else 0


def pick(row: np.ndarray, rng: np.random.Generator, stop: set[int]) -> int:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
    allowed = np.flatnonzero(bits)
    ok = [t for t in allowed[rng.permutation(len(allowed))[:8]] if int(t) not in stop]
    return int(ok[0]) if ok else int(allowed[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=".gpu/tok" if Path(".gpu/tok").is_dir() else "/work/main/.gpu/tok")
    ap.add_argument("--schema", default="scripts/schemas/bench_items.json")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--busy-us", type=float, default=1500.0)
    ap.add_argument("--threads", type=int, default=None, help="LAMINA_GRAMMAR_FILL_THREADS (default: its default)")
    ap.add_argument("--switch-us", type=float, default=None, help="sys.setswitchinterval (default: Python's 5 ms)")
    ap.add_argument("--release-us", type=float, default=0.0, help="a torch op every N us of busy (0: none)")
    ap.add_argument("--pipe", action="store_true", help="LAMINA_GRAMMAR_FILL_PIPE (structured/fill_pipe.py)")
    ap.add_argument("--accept-on-loop", action="store_true", help="LAMINA_GRAMMAR_FILL_ACCEPT_ON_LOOP")
    ap.add_argument("--no-wait-start", action="store_true", help="LAMINA_GRAMMAR_FILL_WAIT_START=0")
    ap.add_argument("--fill-switch-us", type=float, default=None, help="LAMINA_GRAMMAR_FILL_SWITCH_US")
    ap.add_argument("--work", action="store_true", help="busy: a fixed amount of Python work calibrated to "
                    "--busy-us alone, not a wall-clock span (the worker's lock-holding shows as a longer busy)")
    ap.add_argument("--min-rows", type=int, default=None, help="LAMINA_GRAMMAR_FILL_MIN_ROWS")
    ap.add_argument("--count", action="store_true", help="count the step loop's calls (Python and C) per phase")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    if args.switch_us is not None:
        sys.setswitchinterval(args.switch_us * 1e-6)
    from transformers import AutoTokenizer

    from lamina.engine.request import Sequence  # noqa: F401  (the manager's import path, as in the engine)
    from lamina.structured.compiler import GrammarCompilerService
    from lamina.structured.fill import MaskFiller
    from lamina.structured.manager import StructuredOutputManager
    from lamina.structured.params import StructuredOutputsParams
    from lamina.structured.state import GrammarState

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    mgr = StructuredOutputManager(tok, VOCAB, stop, torch.device("cpu"))
    mgr._filler = MaskFiller(args.threads, pipe=args.pipe, accept_on_loop=args.accept_on_loop,
                             wait_start=not args.no_wait_start, switch_us=args.fill_switch_us,
                             min_rows=args.min_rows)
    spec = StructuredOutputsParams(json=json.loads(Path(args.schema).read_text()))
    compiled = mgr.compiler.compile(spec)
    assert isinstance(mgr.compiler, GrammarCompilerService)
    params = SimpleNamespace(bad_words_token_ids=None)
    seqs = [SimpleNamespace(finished=False, grammar=GrammarState(compiled), params=params, draft_token_ids=[],
                            output_token_ids=[]) for _ in range(args.rows)]
    rng = np.random.default_rng(0)
    if args.work:
        chunks, every = calibrate(args.busy_us, args.release_us)
        busy_fn = partial(busy_work, chunks, every)
    else:
        busy_fn = partial(busy, args.busy_us, args.release_us)
    stops = set(stop)
    tokens = [None] * args.rows
    times: dict[str, list[float]] = {k: [] for k in ("accept", "mask_start", "busy", "mask_result", "step")}
    offsets = [0] * args.rows
    calls = [0]

    def prof(frame, event, arg) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    counts: dict[str, list[int]] = {k: [] for k in ("accept", "mask_start", "mask_result")}
    for step in range(args.steps + 10):
        if args.count:
            c0 = calls[0]
            sys.setprofile(prof)
            if tokens[0] is not None:
                for s, t in zip(seqs, tokens):
                    getattr(s.grammar, "push", s.grammar.accept)(t)
            c1 = calls[0]
            pending = mgr.start_bitmask(seqs, offsets)
            c2 = calls[0]
            sys.setprofile(None)
            busy_fn()
            c3 = calls[0]
            sys.setprofile(prof)
            mask = pending.result()
            sys.setprofile(None)
            c4 = calls[0]
            for k, v in zip(counts, (c1 - c0, c2 - c1, c4 - c3)):
                counts[k].append(v)
            host = mask.bitmask.numpy()
            for i, s in enumerate(seqs):
                if s.grammar.terminated:
                    s.grammar = GrammarState(compiled)
                tokens[i] = pick(host[i], rng, stops)
            continue
        t0 = time.perf_counter()
        if tokens[0] is not None:
            for s, t in zip(seqs, tokens):
                getattr(s.grammar, "push", s.grammar.accept)(t)  # push: what the read-back calls (accept before)
        t1 = time.perf_counter()
        pending = mgr.start_bitmask(seqs, offsets)
        t2 = time.perf_counter()
        busy_fn()
        t3 = time.perf_counter()
        mask = pending.result()
        t4 = time.perf_counter()
        if step >= 10:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                times[k].append(v * 1e6)
        host = mask.bitmask.numpy()
        for i, s in enumerate(seqs):
            if s.grammar.terminated:  # start over: the bench's outputs are long
                s.grammar = GrammarState(compiled)
            tokens[i] = pick(host[i], rng, stops)
    if args.count:
        print(f"rows={args.rows} steps={args.steps}: step-loop calls per step (Python + C; median, max)")
        for k, v in counts.items():
            print(f"  {k:12s} {statistics.median(v):8.0f} {max(v):8d}")
        mgr.close()
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    med["extra"] = med["step"] - args.busy_us  # --work: busy itself grows by what the worker took
    q = {k: (statistics.quantiles(v, n=10)[0], statistics.quantiles(v, n=10)[-1]) for k, v in times.items()}
    f = mgr._filler
    print(f"rows={args.rows} steps={args.steps} busy_us={args.busy_us} release_us={args.release_us} "
          f"threads={f.threads} pipe={f.pipe} accept_on_loop={f.accept_on_loop} wait_start={f.wait_start}")
    for k, v in med.items():
        spread = f"  (p10 {q[k][0]:.0f}, p90 {q[k][1]:.0f})" if k in q else ""
        print(f"  {k:12s} {v:8.0f} us/step{spread}")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({"median_us": med, "args": vars(args)}, indent=1))
    mgr.close()


if __name__ == "__main__":
    main()
