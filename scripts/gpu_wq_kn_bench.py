#!/usr/bin/env python3
"""The repacked 4-bit decode GEMV (kernels/triton_wq_gemv_kn.py) against the current one
(triton_wq_matmul.py, heuristic config) and bf16 cuBLAS on the Qwen3-8B shapes, one GPU command (~2 min):

1. correctness first: int4 g128 (GPTQ/AWQ/CT) and g32 (GGUF Q4_K/Q4_0/Q4_1 as int4) at M = 1, 4, 16, on
   the four shapes and an odd N, against the dequantized weight's fp64 matmul (bf16, rel err < 1e-2); each
   call twice (the split-K semaphore reduction must give the same bits and leave the semaphores at zero);
   every swept config; wq_linear's dispatch with the repacked copy (M = 1: kn, M = 16: the old path);
2. per shape, 36 distinct weights in one CUDA graph (so they come from HBM): bf16, old, kn default, kn best
   of a small sweep; the packed-byte bandwidth of kn;
3. the whole step: all 36 layers' four linears in one graph, M = 1 (and M = 4): bf16 vs old vs kn;
4. the tensor-core kn_matmul (same copy) against the old dot path at M = 16 and prefill M = 2048.
Targets (issue 15): W4A16 >= 2.8x bf16, Q4_K >= 2.5x; >= ~3 TB/s of packed bytes.

    OUT=dir python scripts/gpu_wq_kn_bench.py [--layers 36] [--no-sweep]

Writes $OUT/gpu_wq_kn_bench.json. Exits 1 on a failed check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--layers", type=int, default=36)
ARGS.add_argument("--no-sweep", action="store_true")
ARGS.add_argument("--interpret", action="store_true", help="CPU: tiny shapes through the interpreter, checks only")
OPTS = ARGS.parse_args()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpu_timing import rel_err, time_us  # noqa: E402

from lamina.kernels.triton_wq_gemm_kn import kn_matmul  # noqa: E402
from lamina.kernels.triton_wq_gemv_kn import KnConfig, KnWeight, kn_gemv, plan  # noqa: E402
from lamina.kernels.triton_wq_matmul import wq_matmul  # noqa: E402
from lamina.kernels.wq_matmul import dequantize, wq_linear  # noqa: E402

DEV = torch.device("cpu" if OPTS.interpret else "cuda")
DTYPE = torch.float16 if OPTS.interpret else torch.bfloat16  # the interpreter's bf16 dots read raw bits
LAYOUTS = {"int4-g128": 128, "int4-g32": 32}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
SWEEP = [KnConfig(), KnConfig(waves=2), KnConfig(waves=3), KnConfig(waves=8), KnConfig(block_n=128, block_kw=32),
         KnConfig(block_n=512, block_kw=8), KnConfig(num_warps=8), KnConfig(asm=False)]
if OPTS.interpret:
    SHAPES = {"a": (48, 256), "b": (40, 768)}
    SWEEP = [KnConfig(), KnConfig(block_n=16, block_kw=4, split_k=3)]


def weight(n: int, k: int, group: int, gen: torch.Generator):
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8, device=DEV)
    s = (torch.rand(n, k // group, generator=gen, device=DEV) * 0.01 + 0.001).half()
    o = (torch.randn(n, k // group, generator=gen, device=DEV) * 0.02).half()
    return q, s, o


def check(results: list) -> bool:
    ok = True
    gen = torch.Generator(device=DEV).manual_seed(0)
    shapes = dict(SHAPES, odd=(33, 256) if OPTS.interpret else (1001, 4096))
    for label, group in LAYOUTS.items():
        for name, (n, k) in shapes.items():
            q, s, o = weight(n, k, group, gen)
            kn = KnWeight.build(q, s, o)
            wref = dequantize(q, s, o, 4).double()
            for m in (1, 4, 16):
                x = torch.randn(m, k, generator=gen, device=DEV).to(DTYPE)
                ref = x.double() @ wref.t()
                # the sweep at M = 1 on the timed shapes (what it compiles the timing reuses), else the default
                sweep = m == 1 and name != "odd" and not OPTS.no_sweep
                for cfg in SWEEP if sweep else SWEEP[:1]:
                    y1, y2 = kn_gemv(x, kn, cfg), kn_gemv(x, kn, cfg)
                    err, same, clean = rel_err(y1, ref), torch.equal(y1, y2), not kn.locks.any().item()
                    good = err < 1e-2 and same and clean
                    ok &= good
                    results.append({"check": label, "shape": name, "m": m, "config": str(cfg), "rel_err": err,
                                    "stable": same, "locks_clean": clean, "ok": good})
                    if not good:
                        print(f"FAIL {label} {name} m={m} {cfg}: err {err:.2e} stable={same} clean={clean}")
                err = rel_err(kn_matmul(x, kn), ref)  # the tensor-core path on the same copy
                ok &= err < 1e-2
                results.append({"check": label + " kn_matmul", "shape": name, "m": m, "rel_err": err,
                                "ok": err < 1e-2})
                y = wq_linear(x, q, s, o, 4, kn=kn)  # M <= 4: kn; M = 16: the old kernel
                err = rel_err(y, ref)
                ok &= err < 1e-2
                results.append({"check": label + " wq_linear", "shape": name, "m": m, "rel_err": err,
                                "ok": err < 1e-2})
            x = torch.randn(200 if OPTS.interpret else 2048, k, generator=gen, device=DEV).to(DTYPE)
            err = rel_err(kn_matmul(x, kn), x.double() @ wref.t())
            ok &= err < 1e-2
            results.append({"check": label + " kn_matmul", "shape": name, "m": 2048, "rel_err": err, "ok": err < 1e-2})
            if err >= 1e-2:
                print(f"FAIL kn_matmul {label} {name} m=2048: err {err:.2e}")
            kn = wref = None
    return ok


def gemm(results: list) -> None:
    """kn_matmul against the old dot path: M = 16 (36 weights per graph) and prefill M = 2048 (one weight)."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    print(f"{'layout':<10} {'shape':<8} {'M=16 old':>9} {'kn_mm':>9} {'M=2048 old TF/s':>16} {'kn_mm TF/s':>11}")
    for label, group in LAYOUTS.items():
        for nm, (n, k) in SHAPES.items():
            qs = [weight(n, k, group, gen) for _ in range(OPTS.layers)]
            kns = [KnWeight.build(*w) for w in qs]
            x16 = torch.randn(16, k, device=DEV).bfloat16()
            old16 = time_us(lambda i, qs=qs, x16=x16: wq_matmul(x16, *qs[i], 4), copies=OPTS.layers)
            kn16 = time_us(lambda i, kns=kns, x16=x16: kn_matmul(x16, kns[i]), copies=OPTS.layers)
            x = torch.randn(2048, k, device=DEV).bfloat16()
            flop = 2 * 2048 * n * k
            old = flop / time_us(lambda i, q=qs[0], x=x: wq_matmul(x, *q, 4)) / 1e6
            kn = flop / time_us(lambda i, w=kns[0], x=x: kn_matmul(x, w)) / 1e6
            results.append({"timing": "gemm", "layout": label, "shape": nm, "m16_old_us": old16, "m16_kn_us": kn16,
                            "m2048_old_tflops": old, "m2048_kn_tflops": kn})
            print(f"{label:<10} {nm:<8} {old16:9.1f} {kn16:9.1f} {old:16.0f} {kn:11.0f}")
            qs = kns = None
            torch.cuda.empty_cache()


def per_shape(results: list, m: int, sweep: bool) -> dict:
    """{label: {shape: {"old": us, "kn": us, "kn_best": (us, cfg)}}} and bf16 per shape."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    out: dict = {"bf16": {}}
    x = {nm: torch.randn(m, k, device=DEV).bfloat16() for nm, (n, k) in SHAPES.items()}
    for nm, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, generator=gen, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(OPTS.layers)]
        out["bf16"][nm] = time_us(lambda i, ws=ws, nm=nm: F.linear(x[nm], ws[i]), copies=OPTS.layers)
        del ws
    for label, group in LAYOUTS.items():
        out[label] = {}
        for nm, (n, k) in SHAPES.items():
            qs = [weight(n, k, group, gen) for _ in range(OPTS.layers)]
            kns = [KnWeight.build(*w) for w in qs]
            row = {"old": time_us(lambda i, xx=x[nm], qs=qs: wq_matmul(xx, *qs[i], 4), copies=OPTS.layers)}
            timed = {}
            for cfg in SWEEP if sweep else SWEEP[:1]:
                timed[str(cfg)] = time_us(lambda i, cfg=cfg, xx=x[nm], kns=kns: kn_gemv(xx, kns[i], cfg),
                                          copies=OPTS.layers)
            row["kn"] = timed[str(SWEEP[0])]
            best = min(timed, key=timed.get)
            row["kn_best"], row["kn_best_config"], row["kn_sweep"] = timed[best], best, timed
            row["kn_plan"] = plan(n, k // 8, torch.cuda.get_device_properties(DEV).multi_processor_count, SWEEP[0])
            row["packed_bytes"] = n * k // 2 + 4 * n * (k // group)
            row["kn_tb_s"] = row["packed_bytes"] / row["kn"] / 1e6
            row["kn_best_tb_s"] = row["packed_bytes"] / row["kn_best"] / 1e6
            out[label][nm] = row
            qs = kns = None  # free before the next shape's copies
            torch.cuda.empty_cache()
    results.append({"timing": "per shape", "m": m, **out})
    return out


def whole_step(results: list, m: int, picks: dict) -> dict:
    """All layers' four linears in one graph (bf16, old, kn default, kn with the per-shape best)."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    x = {nm: torch.randn(m, k, device=DEV).bfloat16() for nm, (n, k) in SHAPES.items()}
    dense = {nm: [torch.randn(n, k, generator=gen, device=DEV, dtype=torch.bfloat16) * 0.02
                  for _ in range(OPTS.layers)] for nm, (n, k) in SHAPES.items()}
    row = {"timing": "whole step", "m": m, "layers": OPTS.layers,
           "bf16_us": time_us(lambda i, d=dense: [F.linear(x[nm], w) for nm, ws in d.items() for w in ws])}
    dense = None
    torch.cuda.empty_cache()
    for label, group in LAYOUTS.items():
        qs = {nm: [weight(n, k, group, gen) for _ in range(OPTS.layers)] for nm, (n, k) in SHAPES.items()}
        kns = {nm: [KnWeight.build(*w) for w in ws] for nm, ws in qs.items()}
        cfgs = {nm: next((c for c in SWEEP if str(c) == picks.get(label, {}).get(nm)), SWEEP[0]) for nm in SHAPES}
        old = time_us(lambda i, qs=qs: [wq_matmul(x[nm], *w, 4) for nm, ws in qs.items() for w in ws])
        kn = time_us(lambda i, kns=kns: [kn_gemv(x[nm], w) for nm, ws in kns.items() for w in ws])
        best = time_us(lambda i, kns=kns, cfgs=cfgs: [kn_gemv(x[nm], w, cfgs[nm]) for nm, ws in kns.items()
                                                     for w in ws])
        row[label] = {"old_us": old, "kn_us": kn, "kn_best_us": best, "old_x": row["bf16_us"] / old,
                      "kn_x": row["bf16_us"] / kn, "kn_best_x": row["bf16_us"] / best,
                      "kn_best_configs": {nm: str(c) for nm, c in cfgs.items()}}
        qs = kns = None
        torch.cuda.empty_cache()
    results.append(row)
    return row


def dump(results: list) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_wq_kn_bench.json").write_text(json.dumps(results, indent=1))


def main() -> int:
    results: list = []
    ok = check(results)
    print("checks:", "all passed" if ok else "FAILED")
    dump(results)
    if not ok or OPTS.interpret:
        return 0 if ok else 1
    for m in (1, 4):
        shapes = per_shape(results, m, sweep=m == 1 and not OPTS.no_sweep)
        dump(results)
        print(f"M = {m}: per shape, {OPTS.layers} weights per graph, us (kn TB/s of packed bytes)")
        print(f"{'layout':<10} {'shape':<8} {'bf16':>8} {'old':>8} {'kn':>8} {'kn best':>8} {'TB/s':>6}  best config")
        for label in LAYOUTS:
            for nm in SHAPES:
                r = shapes[label][nm]
                print(f"{label:<10} {nm:<8} {shapes['bf16'][nm]:8.1f} {r['old']:8.1f} {r['kn']:8.1f} "
                      f"{r['kn_best']:8.1f} {r['kn_best_tb_s']:6.2f}  {r['kn_best_config']}")
        picks = {label: {nm: shapes[label][nm]["kn_best_config"] for nm in SHAPES} for label in LAYOUTS}
        step = whole_step(results, m, picks)
        dump(results)
        print(f"M = {m}: whole step ({OPTS.layers} layers, one graph): bf16 {step['bf16_us']:.0f} us")
        for label in LAYOUTS:
            r = step[label]
            print(f"  {label}: old {r['old_us']:.0f} us = {r['old_x']:.2f}x, kn {r['kn_us']:.0f} us = "
                  f"{r['kn_x']:.2f}x, kn best {r['kn_best_us']:.0f} us = {r['kn_best_x']:.2f}x")
    gemm(results)
    dump(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
