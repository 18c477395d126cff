#!/usr/bin/env python3
"""4-bit decode linears on the Qwen3-8B shapes at M = 1, 2, 4, 8, 16: bf16 cuBLAS, the old default
(triton_wq_matmul's heuristic), the new untimed default (wq_dispatch.heuristic_path, on the repacked kn copy)
and the new dispatcher's timed picks (wq_dispatch.WqDispatcher), one GPU command (<= ~4 min):

1. correctness first: every path the dispatcher may pick or time (candidates_for) at every M, int4 g128
   (GPTQ/AWQ/CT) and g32 (GGUF Q4_K/Q4_0/Q4_1 as int4), on the four shapes and (g128) an odd N (M = 1, 3, 16),
   against the dequantized weight's fp64 matmul (bf16 activations, rel err < 1e-2); each call twice (the
   split-K semaphores must give the same bits and be back at zero); wq_linear through the dispatcher;
2. per shape, 36 distinct weights per CUDA graph (so they come from HBM), and the 36-layer step (all four
   linears of 36 layers in one graph), for the four methods; the dispatcher's timings per shape.
Targets (issue 15): W4A16 >= 2.8x bf16 at M = 1; never slower than bf16 at M = 2..16.

    OUT=dir python scripts/gpu_wq_kn_bench.py [--layers 36] [--budget 220] [--interpret]

Writes $OUT/gpu_wq_kn_bench.json. Exits 1 on a failed check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--layers", type=int, default=36)
ARGS.add_argument("--budget", type=float, default=220.0, help="seconds; later timing sections are skipped")
ARGS.add_argument("--interpret", action="store_true", help="CPU: tiny shapes through the interpreter, checks only")
OPTS = ARGS.parse_args()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpu_timing import rel_err, time_us  # noqa: E402

from lamina.kernels.triton_wq_gemv_kn import KnWeight  # noqa: E402
from lamina.kernels.triton_wq_matmul import wq_matmul  # noqa: E402
from lamina.kernels.wq_dispatch import WqDispatcher, candidates_for, heuristic_path, run_path  # noqa: E402
from lamina.kernels.wq_matmul import dequantize, wq_linear  # noqa: E402

START = time.monotonic()
DEV = torch.device("cpu" if OPTS.interpret else "cuda")
DTYPE = torch.float16 if OPTS.interpret else torch.bfloat16  # the interpreter's bf16 dots read raw bits
LAYOUTS = {"int4-g128": 128, "int4-g32": 32}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
MS = (1, 2, 4, 8, 16)
METHODS = ("bf16", "old", "new", "tuned")
if OPTS.interpret:
    SHAPES = {"a": (48, 256), "b": (40, 768)}
    MS = (1, 4, 16)


def sms() -> int:
    return torch.cuda.get_device_properties(DEV).multi_processor_count if DEV.type == "cuda" else 132


def weight(n: int, k: int, group: int, gen: torch.Generator):
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8, device=DEV)
    s = (torch.rand(n, k // group, generator=gen, device=DEV) * 0.01 + 0.001).half()
    o = (torch.randn(n, k // group, generator=gen, device=DEV) * 0.02).half()
    return q, s, o


def check(results: list) -> bool:
    ok = True
    gen = torch.Generator(device=DEV).manual_seed(0)
    for label, group in LAYOUTS.items():
        # the odd N (ragged last tiles) once: its plans are compiles of their own
        shapes = dict(SHAPES, odd=(33, 256) if OPTS.interpret else (1001, 4096)) if group == 128 else SHAPES
        for name, (n, k) in shapes.items():
            q, s, o = weight(n, k, group, gen)
            kn = KnWeight.build(q, s, o)
            wref = dequantize(q, s, o, 4).double()
            for m in (1, 3, 16) if name == "odd" else MS:
                x = torch.randn(m, k, generator=gen, device=DEV).to(DTYPE)
                ref = x.double() @ wref.t()
                bucket = 1 << (m - 1).bit_length()
                for path in candidates_for(bucket, n, k, group, 4, sms(), True):
                    y1, y2 = (run_path(path, x, q, s, o, 4, kn) for _ in range(2))
                    err, same, clean = rel_err(y1, ref), torch.equal(y1, y2), not kn.locks.any().item()
                    good = err < 1e-2 and same and clean
                    ok &= good
                    results.append({"check": label, "shape": name, "m": m, "path": path.label(), "rel_err": err,
                                    "stable": same, "locks_clean": clean, "ok": good})
                    if not good:
                        print(f"FAIL {label} {name} m={m} {path.label()}: err {err:.2e} stable={same} clean={clean}")
                for w in (kn, None):  # the process dispatcher: untimed picks unless LAMINA_WQ_TUNE=1
                    err = rel_err(wq_linear(x, q, s, o, 4, kn=w), ref)
                    ok &= err < 1e-2
                    results.append({"check": label + " wq_linear", "shape": name, "m": m, "kn": w is not None,
                                    "rel_err": err, "ok": err < 1e-2})
                    if err >= 1e-2:
                        print(f"FAIL wq_linear {label} {name} m={m} kn={w is not None}: err {err:.2e}")
            kn = wref = None
    return ok


def fns(method: str, nm: str, x: torch.Tensor, dense: dict, qs: dict, kns: dict, disp: WqDispatcher):
    """fn(i): the method's call on layer i's weight of shape nm."""
    n, k = SHAPES[nm]
    group = k // qs[nm][0][1].shape[1]
    if method == "bf16":
        return lambda i: F.linear(x, dense[nm][i])
    if method == "old":
        return lambda i: wq_matmul(x, *qs[nm][i], 4)
    if method == "new":
        path = heuristic_path(x.shape[0], n, k, group, 4, sms(), True)
        return lambda i: run_path(path, x, *qs[nm][i], 4, kns[nm][i])
    disp(x, *qs[nm][0], 4, kns[nm][0])  # tunes this (M bucket, shape) now, outside any capture
    return lambda i: disp(x, *qs[nm][i], 4, kns[nm][i])


def timings(results: list) -> None:
    gen = torch.Generator(device=DEV).manual_seed(1)
    dense = {nm: [torch.randn(n, k, generator=gen, device=DEV, dtype=torch.bfloat16) * 0.02
                  for _ in range(OPTS.layers)] for nm, (n, k) in SHAPES.items()}
    for label, group in LAYOUTS.items():
        qs = {nm: [weight(n, k, group, gen) for _ in range(OPTS.layers)] for nm, (n, k) in SHAPES.items()}
        kns = {nm: [KnWeight.build(*w) for w in ws] for nm, ws in qs.items()}
        disp = WqDispatcher(tune=True)
        for m in MS:
            if time.monotonic() - START > OPTS.budget:
                print(f"budget spent: {label} M >= {m} skipped")
                break
            x = {nm: torch.randn(m, k, device=DEV).bfloat16() for nm, (n, k) in SHAPES.items()}
            row: dict = {"timing": "per shape", "layout": label, "m": m}
            calls = {}
            for nm in SHAPES:
                calls[nm] = {me: fns(me, nm, x[nm], dense, qs, kns, disp) for me in METHODS}
                row[nm] = {me: time_us(fn, copies=OPTS.layers) for me, fn in calls[nm].items()}
                key = next(kk for kk in disp.paths if kk[:3] == (1 << (m - 1).bit_length(), *SHAPES[nm]))
                row[nm]["tuned_path"] = disp.paths[key].label()
                row[nm]["new_path"] = heuristic_path(m, *SHAPES[nm], group, 4, sms(), True).label()
                row[nm]["tuner"] = disp.timings.get(key, [])
                row[nm]["rejected"] = disp.rejected.get(key, [])
            row["step"] = {me: time_us(lambda i, me=me, calls=calls: [calls[nm][me](j) for nm in SHAPES
                                                                     for j in range(OPTS.layers)])
                           for me in METHODS}
            results.append(row)
            dump(results)
            report(row)
        qs = kns = disp = None
        torch.cuda.empty_cache()


def report(row: dict) -> None:
    step = row["step"]
    print(f"{row['layout']} M = {row['m']}: us per call, {OPTS.layers} weights per graph (x = bf16 / method)")
    print(f"  {'shape':<8} {'bf16':>7} {'old':>7} {'new':>7} {'tuned':>7} {'old x':>6} {'new x':>6} {'tuned x':>7}"
          f"  tuned path")
    for nm in SHAPES:
        r = row[nm]
        print(f"  {nm:<8} {r['bf16']:7.1f} {r['old']:7.1f} {r['new']:7.1f} {r['tuned']:7.1f} "
              f"{r['bf16'] / r['old']:6.2f} {r['bf16'] / r['new']:6.2f} {r['bf16'] / r['tuned']:7.2f}  "
              f"{r['tuned_path']}" + (f"  rejected: {r['rejected']}" if r["rejected"] else ""))
    print(f"  {'step':<8} {step['bf16']:7.0f} {step['old']:7.0f} {step['new']:7.0f} {step['tuned']:7.0f} "
          f"{step['bf16'] / step['old']:6.2f} {step['bf16'] / step['new']:6.2f} {step['bf16'] / step['tuned']:7.2f}"
          f"  ({OPTS.layers} layers x 4 linears, one graph)", flush=True)


def dump(results: list) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_wq_kn_bench.json").write_text(json.dumps(results, indent=1, default=str))


def main() -> int:
    results: list = []
    ok = check(results)
    print(f"checks: {'all passed' if ok else 'FAILED'} ({time.monotonic() - START:.0f} s)", flush=True)
    dump(results)
    if not ok or OPTS.interpret:
        return 0 if ok else 1
    timings(results)
    dump(results)
    print(f"done in {time.monotonic() - START:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
