#!/usr/bin/env python3
"""The skinny FP8 decode GEMM (triton_fp8_skinny.py) on the GPU, checks first, then timings (GPU stage
`fp8skinny`, <= 240 s on an H200):

1. checks, natively: every e4m3 code (subnormals included) through both variants exactly against the
   dequantized weight; rows far outside fp16's range (tc16's scaling); a split-K launch replayed in a CUDA
   graph; then each Qwen3-8B projection at M = 1, 2, 4, 8, 16, rows and 128x128 blocks, the default config
   of each variant vs the fp64 dequantized matmul (tol 1e-2);
2. timings with cold weights (copies rotated past the L2, CUDA-graph replays): per shape and M, bf16
   F.linear, the old default (fp8_gemv's heuristic), tc16 and tc defaults, and a config sweep (candidate_configs)
   at M = 1 and 16 for block scales while the budget lasts; then the 36-layer sums per M and the proposed
   default per M range.

    python scripts/fp8_skinny_bench.py [--budget 220]          (CUDA)
    python scripts/fp8_skinny_bench.py --interpret             (CPU: tiny shapes, checks only)
Writes $OUT/fp8_skinny_bench.json when OUT is set. Exits 1 on any failed check.
"""
# ruff: noqa: B023  (every timed lambda runs inside its loop iteration)
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--interpret", action="store_true")
ARGS.add_argument("--budget", type=float, default=220.0)
OPTS = ARGS.parse_args()
START = time.monotonic()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if OPTS.interpret:
    from lamina.kernels.interpreter import patch_triton_interpreter

    patch_triton_interpreter()

from gpu_timing import rel_err, time_us  # noqa: E402

from lamina.kernels.fp8 import FP8, dequantize, quantize_blocks, quantize_rows  # noqa: E402
from lamina.kernels.triton_fp8_gemv import fp8_gemv  # noqa: E402
from lamina.kernels.triton_fp8_skinny import SkinnyConfig, candidate_configs, default_config, fp8_skinny  # noqa: E402

BENCH = not OPTS.interpret
DEV = torch.device("cuda" if BENCH else "cpu")
DT = torch.bfloat16 if BENCH else torch.float16
LAYERS = 36
MS = (1, 2, 4, 8, 16)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
if not BENCH:
    SHAPES = {"tiny": (192, 256)}
    MS = (1, 5)
FAILED: list[str] = []
RESULT: dict = {"checks": {}, "rows": [], "sweep": {}, "sums": {}}
VARIANTS = ("tc16", "tc")
SWEEPS: list[tuple] = []  # (row, sweep() arguments) queued by shapes()


def check(label: str, err: float, tol: float) -> None:
    ok = err < tol
    RESULT["checks"][label] = err
    print(f"  {'ok ' if ok else 'FAIL'} {label}: rel err {err:.2e} (tol {tol:.0e})", flush=True)
    if not ok:
        FAILED.append(label)


def all_codes() -> None:
    """Every finite e4m3 code, each row a permutation, x = one-hot rows and a random row: the products are the
    codes themselves (times the scale), so a conversion that flushes subnormals or rounds shows up."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # drop the two NaNs: 254 codes
    k = 256
    g = torch.Generator().manual_seed(3)
    rows = [torch.cat([codes, codes[:2]])[torch.randperm(k, generator=g)] for _ in range(64)]
    q = torch.stack(rows).view(FP8).to(DEV)
    s = (torch.rand(64, generator=g) + 0.5).to(DEV)
    x = torch.cat([torch.eye(k)[:15], torch.randn(1, k, generator=g)]).to(DT).to(DEV)
    ref = x.double() @ dequantize(q, s, None, torch.float64).T
    for v in VARIANTS:
        y = fp8_skinny(x, q, s, None, config=SkinnyConfig(v, 64, 64, 1, 4, 2))
        exact = (y[:15].double() - ref[:15].to(DT).double()).abs().max().item()  # one-hot rows: one product each
        check(f"all codes {v} one-hot (max abs diff)", exact, 1e-30)
        check(f"all codes {v} random row", rel_err(y[15:], ref[15:]), 1e-2)


def wide_rows() -> None:
    n, k = 128, 512
    q, s = quantize_blocks(torch.randn(n, k, device=DEV), (128, 128))
    x = torch.randn(4, k, device=DEV)
    x[0] *= 3e6  # past fp16's 65504
    x[1] *= 1e-9
    x = x.to(torch.bfloat16)  # the model's dtype (fp16 could not hold these rows at all)
    ref = x.double() @ dequantize(q, s, (128, 128), torch.float64).T
    for v in VARIANTS:
        y = fp8_skinny(x, q, s, (128, 128), config=SkinnyConfig(v, 64, 128, 2, 4, 2))
        check(f"wide rows {v}", max(rel_err(y[i], ref[i]) for i in range(4)), 1e-2)


def graph_replay() -> None:
    if not BENCH:
        return
    n, k = 4096, 4096
    q, s = quantize_blocks(torch.randn(n, k, device=DEV) * 0.02, (128, 128))
    x = torch.randn(3, k, device=DEV, dtype=DT)
    cfg = SkinnyConfig("tc16", 64, 128, 8, 4, 4)
    fp8_skinny(x, q, s, (128, 128), config=cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_skinny(x, q, s, (128, 128), config=cfg)
    graph.replay()
    first = y.clone()
    graph.replay()
    ref = x.double() @ dequantize(q, s, (128, 128), torch.float64).T
    check("split-K graph replay (same bits twice)", float(not torch.equal(first, y)), 0.5)
    check("split-K graph replay vs reference", rel_err(y, ref), 1e-2)


def label(c) -> str:
    return c.label() if isinstance(c, SkinnyConfig) else "gemv-default"


def shapes() -> None:
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=DEV) * 0.02
        schemes = {"rows": (None, *quantize_rows(w)), "block128": ((128, 128), *quantize_blocks(w, (128, 128)))}
        copies = max(1, -(-256 * 2**20 // (n * k * 2))) if BENCH else 1
        wbs = [w.to(torch.bfloat16) for _ in range(copies)] if BENCH else []
        qss = {sn: [(q.clone(), sc.clone()) for _ in range(copies)] for sn, (_, q, sc) in schemes.items()}
        for m in MS:
            x = torch.randn(m, k, device=DEV).to(DT)
            row = {"shape": name, "n": n, "k": k, "m": m}
            if BENCH:
                row["bf16_us"] = time_us(lambda i: F.linear(x, wbs[i]), copies)
            for sn, (block, q, sc) in schemes.items():
                ref = x.double() @ dequantize(q, sc, block, torch.float64).T
                for v in VARIANTS:
                    cfg = default_config(m, n, k, block, DEV, v)
                    check(f"{name} m{m} {sn} {cfg.label()}", rel_err(fp8_skinny(x, q, sc, block, config=cfg), ref),
                          1e-2)
                    if BENCH:
                        row[f"{sn}_{v}_us"] = time_us(
                            lambda i: fp8_skinny(x, *qss[sn][i], block, config=cfg), copies)
                if BENCH:
                    row[f"{sn}_old_us"] = time_us(lambda i: fp8_gemv(x, *qss[sn][i], block), copies)
                    if sn == "block128" and m in (1, 16):  # swept after every default is timed (budget)
                        SWEEPS.append((row, name, x, block, q, sc, ref, qss[sn], copies))
            RESULT["rows"].append(row)
            if BENCH:
                print(f"  {name} m{m}: " + ", ".join(f"{kk[:-3]} {vv:.1f}" for kk, vv in row.items()
                                                     if kk.endswith("_us")), flush=True)


def sweep(name, x, block, q, sc, ref, qs, copies) -> dict:
    out = {}
    m, k = x.shape
    for cfg in candidate_configs(m, q.shape[0], k, block, DEV, "tc16"):
        if time.monotonic() - START > 0.8 * OPTS.budget:
            out[cfg.label()] = "skipped: budget"
            continue
        try:
            err = rel_err(fp8_skinny(x, q, sc, block, config=cfg), ref)
        except Exception as e:  # a config the compiler refuses is reported, not fatal
            out[cfg.label()] = f"error: {type(e).__name__}: {str(e)[:100]}"
            continue
        check(f"sweep {name} m{m} {cfg.label()}", err, 1e-2)
        out[cfg.label()] = time_us(lambda i: fp8_skinny(x, *qs[i], block, config=cfg), copies)
    best = min((v, kk) for kk, v in out.items() if isinstance(v, float)) if out else None
    if best:
        print(f"  sweep {name} m{m} block128: best {best[1]} {best[0]:.1f} us", flush=True)
    return out


def sums() -> None:
    """36 x the four projections per M: bf16, old default, new defaults, the swept best (block scales)."""
    for m in MS:
        rows = [r for r in RESULT["rows"] if r["m"] == m]
        if len(rows) != len(SHAPES):
            continue
        est = {key: LAYERS * sum(r[key] for r in rows) for key in rows[0] if key.endswith("_us")}
        sw = [{kk: v for kk, v in r.get("sweep", {}).items() if isinstance(v, float)} for r in rows]
        if all(sw):
            est["block128_swept_best_us"] = LAYERS * sum(min(s.values()) for s in sw)
            est["block128_best_configs"] = {r["shape"]: min(s, key=s.get) for r, s in zip(rows, sw)}
        for key in [kk for kk in est if kk.endswith("_us") and kk != "bf16_us"]:
            est[key.replace("_us", "_x_bf16")] = round(est["bf16_us"] / est[key], 3)
        for sn in ("rows", "block128"):  # the proposed default for this M: the fastest untuned path
            keys = [f"{sn}_{v}_us" for v in ("old",) + VARIANTS]
            est[f"propose_{sn}"] = min(keys, key=est.get)
        RESULT["sums"][f"m{m}"] = est
        print(f"36 layers M={m}: " + json.dumps({kk: (round(v, 1) if isinstance(v, float) else v)
                                                for kk, v in est.items()}), flush=True)


def dump() -> None:
    RESULT["failed"] = FAILED
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8_skinny_bench.json").write_text(json.dumps(RESULT, indent=1))


def main() -> int:
    torch.manual_seed(0)
    print("checks")
    all_codes()
    wide_rows()
    graph_replay()
    dump()
    print("per shape (us; rows/block128 x old GEMV default / tc16 / tc)")
    shapes()
    if BENCH:
        sums()
        dump()
        print("block128 config sweep at M = 1 and 16 (tc16)")
        for row, *args in SWEEPS:
            row["sweep"] = sweep(*args)
        sums()
    dump()
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
