#!/usr/bin/env python3
"""Checks and times the weight-quantized matmul (kernels/triton_wq_matmul.py) on the Qwen3-8B shapes, one
command on the GPU (a few minutes on an H200):

1. correctness: every layout (int4 group 128 = GPTQ/AWQ/compressed-tensors W4A16, int4 group 32 = GGUF
   Q4_0/Q4_1/Q4_K, int8 group 16/32 = GGUF Q6_K/Q5_K/Q8_0) at M = 1, 4, 16, 128, 2048 against the
   dequantized weight's fp32 matmul, bf16 and fp16, the split-K results re-run for bitwise stability;
2. timing: the linear layers of one batch-1 (and M = 4, 16) decode step of all 36 layers (qkv 6144 x 4096,
   o 4096 x 4096, gate|up 24576 x 4096, down 4096 x 12288; distinct weights per layer, so they come from
   HBM), captured in a CUDA graph, against bf16 F.linear (cuBLAS) on the same shapes; every candidate
   config is timed and the heuristic's pick reported next to the best. Targets (issue 15, model level):
   W4A16 >= 2.8x bf16, GGUF Q4_K >= 2.5x; these linears are ~95% of an 8B decode step's bytes.
   FP8 (the decode GEMV, row and 128x128 block scales) is timed the same way, so the batch-1 figures of
   bf16, FP8, W4A16 and GGUF Q4_K come from one methodology (target FP8 >= 1.75x);
3. prefill: one layer's four matmuls at M = 2048 (TFLOP/s against bf16 cuBLAS).

--quick (what scripts/quant_targets.py runs, ~1 minute): checks at M = 1, 16, 2048 in bf16 only, the
decode timing at M = 1 and 16 with the heuristic configs only (no sweep), prefill with the heuristic only.
--quick --sweep (~2 minutes): the same, plus every variant of candidates() for the 4-bit layouts (checked
for correctness on the first shape, then timed; per_config_us / per_config_tflops in the JSON).

    python scripts/gpu_wq_bench.py                 # CUDA
    python scripts/gpu_wq_bench.py --interpret     # CPU: tiny shapes through TRITON_INTERPRET=1, checks only

Writes $OUT/gpu_wq_bench.json when OUT is set. Exits 1 on a failed check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--interpret", action="store_true")
ARGS.add_argument("--layers", type=int, default=36)
ARGS.add_argument("--quick", action="store_true")
ARGS.add_argument("--sweep", action="store_true", help="with --quick: time every variant for the 4-bit layouts")
OPTS = ARGS.parse_args()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if OPTS.interpret:
    from lamina.kernels.interpreter import patch_triton_interpreter

    patch_triton_interpreter()
from lamina.kernels.fp8 import quantize_blocks, quantize_rows  # noqa: E402
from lamina.kernels.triton_fp8_gemv import fp8_gemv  # noqa: E402
from lamina.kernels.triton_wq_matmul import WqConfig, heuristic_config, wq_matmul  # noqa: E402
from lamina.kernels.wq_matmul import dequantize  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYOUTS = {"int4-g128 (W4A16)": (4, 128), "int4-g32 (GGUF Q4_K/Q4_0/Q4_1)": (4, 32),
           "int8-g16 (GGUF Q6_K)": (8, 16), "int8-g32 (GGUF Q8_0/Q5_K)": (8, 32)}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
if OPTS.interpret:
    SHAPES = {"a": (48, 256), "b": (40, 128)}


def weight(n: int, k: int, bits: int, group: int, gen: torch.Generator):
    """Random integers, scales and offsets, drawn on the device (36 layers of 8B weights from the CPU's
    generator took most of a minute per layout)."""
    q = torch.randint(0, 256, (n, k // 2 if bits == 4 else k), generator=gen, dtype=torch.uint8, device=DEV)
    if bits == 8:
        q = q.view(torch.int8)
    s = (torch.rand(n, k // group, generator=gen, device=DEV) * 0.01 + 0.001).half()
    o = (torch.randn(n, k // group, generator=gen, device=DEV) * 0.02).half()
    return q, s, o


def device_gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def candidates(m: int, n: int, k: int, group: int, bits: int) -> list[WqConfig]:
    """The heuristic's pick first, then the variants (triton_wq_matmul.KERNELS) and tilings worth timing.
    --quick: the heuristic only; --quick --sweep: the sweep for the 4-bit layouts (the targets)."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count if DEV.type == "cuda" else 8
    out = [heuristic_config(m, n, k, group, sms, bits)]
    if OPTS.quick and not (OPTS.sweep and bits == 4):
        return out
    # ~16 variants per layout (each one compile, 1-3 s on the GPU host): kept short for a 120 s call.
    if m <= 4:
        h = out[0]
        out += [WqConfig("gemv", 1, bn, bk, 1, num_stages=1) for bn, bk in ((8, 1024), (16, 512), (32, 512))]
        out += [WqConfig("gemv_pf", 1, bn, bk, 1, num_stages=1) for bn, bk in ((8, 1024), (16, 512))]
        out += [WqConfig("gemv_cvt", 1, h.block_n, h.block_k, h.split_k, num_stages=1),
                WqConfig("dot_join", 16, 32, 128, num_stages=4)]
    elif m <= 16:
        out += [WqConfig("dot", 16, 32, 128, num_stages=4), WqConfig("dot_join", 16, 32, 128, num_stages=4),
                WqConfig("dot_join", 16, 64, 256, num_stages=3), WqConfig("gemv_pf", 1, 8, 1024, num_stages=1)]
    else:
        out += [WqConfig(kern, bm, bn, bk, 1, num_warps=8 if bm * bn >= 128 * 128 else 4, num_stages=3)
                for kern, bm, bn, bk in (("dot", 128, 128, 64), ("dot_join", 128, 128, 64),
                                         ("dot_join", 128, 256, 64), ("dot_join", 64, 128, 64))]
    return list(dict.fromkeys(out))


def check(results: list) -> bool:
    ok = True
    gen = device_gen(0)
    ms = (1, 16, 2048) if OPTS.quick else (1, 4, 16, 128, 2048)
    dtypes = (torch.bfloat16,) if OPTS.quick else (torch.bfloat16, torch.float16)
    for label, (bits, group) in LAYOUTS.items():
        for name, (n, k) in SHAPES.items():
            q, s, o = weight(n, k, bits, group, gen)
            w = dequantize(q, s, o, bits)
            for m in ((1, 4, 16, 37) if OPTS.interpret else ms):
                x = torch.randn(m, k, generator=gen, device=DEV)
                ref = x.double() @ w.double().t()
                for dtype in ((torch.float16,) if OPTS.interpret else dtypes):
                    xd = x.to(dtype)
                    y1 = wq_matmul(xd, q, s, o, bits)
                    err = rel_err(y1, ref)
                    tol = 1e-2 if dtype == torch.bfloat16 else 3e-3
                    stable = bool(torch.equal(y1, wq_matmul(xd, q, s, o, bits)))
                    good = err < tol and (stable or heuristic_config(m, n, k, group, 132, bits).split_k > 1)
                    ok &= good
                    results.append({"check": label, "shape": name, "m": m, "dtype": str(dtype), "rel_err": err,
                                    "bitwise_stable": stable, "ok": good})
                    if not good:
                        print(f"FAIL {label} {name} m={m} {dtype}: rel err {err:.2e} stable={stable}")
                    if OPTS.sweep and name == next(iter(SHAPES)):  # every variant the sweep may pick as best
                        for cfg in candidates(m, n, k, group, bits)[1:]:
                            try:
                                err = rel_err(wq_matmul(xd, q, s, o, bits, cfg), ref)
                            except Exception as e:  # out of resources: the timing skips it too
                                print(f"skip {cfg}: {type(e).__name__}")
                                continue
                            ok &= err < tol
                            results.append({"check": label, "shape": name, "m": m, "dtype": str(dtype),
                                            "config": str(cfg), "rel_err": err, "ok": err < tol})
                            if err >= tol:
                                print(f"FAIL {label} {name} m={m} {dtype} {cfg}: rel err {err:.2e}")
    return ok


def graph_us(fn, replays: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    samples = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3)
    return sorted(samples)[len(samples) // 2]


def time_decode(results: list) -> None:
    gen = device_gen(1)
    layers = OPTS.layers
    dense = {name: [torch.randn(n, k, generator=gen, device=DEV, dtype=torch.bfloat16) * 0.02
                    for _ in range(layers)] for name, (n, k) in SHAPES.items()}
    for m in (1, 16) if OPTS.quick else (1, 4, 16):
        xs = {name: torch.randn(m, shape[1], device=DEV, dtype=torch.bfloat16) for name, shape in SHAPES.items()}

        def run_dense(xs=xs):
            return [F.linear(xs[nm], w) for nm, ws in dense.items() for w in ws]

        bf16 = graph_us(run_dense)
        row = {"timing": "decode step linears", "m": m, "layers": layers, "bf16_us": bf16}
        for label, (bits, group) in LAYOUTS.items():
            qw = {nm: [weight(n, k, bits, group, gen) for _ in range(layers)] for nm, (n, k) in SHAPES.items()}
            best_total, heur_total, picks, sweeps = 0.0, 0.0, {}, {}
            for nm, (n, k) in SHAPES.items():
                timed = []
                per_config = {}
                for cfg in candidates(m, n, k, group, bits):
                    try:
                        def run(x=xs[nm], ws=qw[nm], bits=bits, cfg=cfg):
                            return [wq_matmul(x, *w, bits, cfg) for w in ws]

                        us = graph_us(run)
                    except Exception as e:  # a config that does not compile for this shape (resources)
                        print(f"skip {cfg}: {type(e).__name__}")
                        continue
                    timed.append((us, cfg))
                    per_config[str(cfg)] = us
                sweeps[nm] = per_config
                heur_total += timed[0][0]
                us, cfg = min(timed, key=lambda t: t[0])
                best_total += us
                picks[nm] = str(cfg)
            row[label] = {"heuristic_us": heur_total, "best_us": best_total, "speedup_heuristic": bf16 / heur_total,
                          "speedup_best": bf16 / best_total, "best_configs": picks,
                          "heuristic_configs": {nm: str(candidates(m, *shape, group, bits)[0])
                                                for nm, shape in SHAPES.items()},
                          "per_config_us": sweeps}
            del qw
            torch.cuda.empty_cache()
        for label, block in (("fp8 rows", None), ("fp8 block128", (128, 128))):
            total = 0.0
            for nm, ws in dense.items():
                qs = [quantize_blocks(w, block) if block else quantize_rows(w) for w in ws]
                total += graph_us(lambda x=xs[nm], qs=qs, block=block: [fp8_gemv(x, q, sc, block) for q, sc in qs])
                del qs
            row[label] = {"heuristic_us": total, "speedup_heuristic": bf16 / total}
            torch.cuda.empty_cache()
        results.append(row)
        print(json.dumps(row, indent=1))
        dump(results)


def time_prefill(results: list) -> None:
    gen = device_gen(2)
    m = 2048
    for name, (n, k) in SHAPES.items():
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, generator=gen, device=DEV, dtype=torch.bfloat16)
        bf16 = graph_us(lambda x=x, w=w: F.linear(x, w))
        row = {"timing": "prefill", "shape": name, "m": m, "bf16_tflops": 2 * m * n * k / bf16 / 1e6}
        for label, (bits, group) in LAYOUTS.items():
            q = weight(n, k, bits, group, gen)
            timed = {str(c): graph_us(lambda x=x, q=q, b=bits, c=c: wq_matmul(x, *q, b, c))
                     for c in candidates(m, n, k, group, bits)}
            best = min(timed.values())
            row[label + " tflops"] = 2 * m * n * k / best / 1e6
            row[label + " heuristic tflops"] = 2 * m * n * k / next(iter(timed.values())) / 1e6
            row[label + " per_config_tflops"] = {c: 2 * m * n * k / us / 1e6 for c, us in timed.items()}
        results.append(row)
        print(json.dumps(row))


def dump(results: list) -> None:
    """$OUT/gpu_wq_bench.json, rewritten after every stage (a run cut off at its time limit keeps what it did)."""
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_wq_bench.json").write_text(json.dumps(results, indent=1))


def main() -> int:
    results: list = []
    ok = check(results)
    print("checks:", "all passed" if ok else "FAILED")
    dump(results)
    if DEV.type == "cuda":
        time_decode(results)
        dump(results)
        time_prefill(results)
    dump(results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
