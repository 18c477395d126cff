#!/usr/bin/env python3
"""Checks and times this round's decode kernels on the GPU (one call, < 3 minutes on an H200):

1. the fused q/k RMSNorm + RoPE + KV store (triton_attention_prep) against its torch reference on fresh random
   inputs (bf16/fp16/fp32; norm or none, partial rotary, the gated q layout, padding slots), outputs and caches
   NaN-poisoned, then timed (CUDA-graph replay) against the separate launches it replaces;
2. the decode GEMV (triton_gemv): every candidate config on the Qwen3-8B decode shapes at M = 1, 2, 4, 8, 16,
   checked against an fp32 F.linear (and re-run to catch a split-K race: results must be bitwise stable),
   timed against F.linear (cuBLAS) with weights cold (several weight copies rotated past the L2), plus the
   config GemvDispatcher's own timing picks.

    python scripts/gpu_kernel_bench.py               # CUDA: checks + timings, a table at the end
    python scripts/gpu_kernel_bench.py --interpret   # CPU: tiny shapes through TRITON_INTERPRET=1, checks only

Writes $OUT/gpu_kernel_bench.json when OUT is set. Exits 1 on any failed check.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--interpret", action="store_true")
ARGS.add_argument("--gemv-only", action="store_true", help="skip the q/k-norm + RoPE + KV-store section")
ARGS.add_argument("--ms", default="1,2,4,8,16", help="GEMV rows to time, comma-separated")
ARGS.add_argument("--budget-s", type=float, default=150, help="GEMV shapes not started by then are skipped")
OPTS = ARGS.parse_args()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

if OPTS.interpret:
    from lamina.kernels.interpreter import patch_triton_interpreter

    patch_triton_interpreter()

from lamina.kernels.attention_prep import qk_norm_rope_store_ref
from lamina.kernels.gemv import GemvDispatcher
from lamina.kernels.rope import rope_cos_sin_cache, rope_inv_freq
from lamina.kernels.triton_attention import store_kv_triton
from lamina.kernels.triton_attention_prep import qk_norm_rope_store_triton
from lamina.kernels.triton_gemv import candidate_configs, gemv, new_workspace
from lamina.kernels.triton_norm import rms_norm_triton
from lamina.kernels.triton_rope import apply_rope_triton

DEV = torch.device("cpu" if OPTS.interpret else "cuda")
BENCH = not OPTS.interpret
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FAILED: list[str] = []
RESULT: dict = {"prep": [], "gemv": []}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def graph_us(fn, reps: int, replays: int = 15) -> float:
    """Median microseconds per call of fn(i), i = 0..reps-1, captured back to back in one CUDA graph. No L2
    flush between replays (do_bench's flush is a 256 MB write whose dirty lines would be written back during
    the timed calls): callers that need cold weights rotate enough copies through the graph instead."""
    for i in range(min(reps, 2)):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    for _ in range(2):
        graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(samples)[len(samples) // 2]


# ---------------------------------------------------------------- fused q/k norm + RoPE + KV store

# name: (tokens, Hq, Hkv, D, rot_dim, qk_norm, offset, gated, dtypes)
ALL = (torch.bfloat16, torch.float16, torch.float32)
PREP_CASES = {
    "qwen3-8b T1": (1, 32, 8, 128, 128, True, 0.0, False, ALL),
    "qwen3-8b T16": (16, 32, 8, 128, 128, True, 0.0, False, ALL),
    "qwen3-8b T64": (64, 32, 8, 128, 128, True, 0.0, False, (torch.bfloat16,)),
    "qwen3-8b T4096": (4096, 32, 8, 128, 128, True, 0.0, False, (torch.bfloat16,)),
    "llama no-norm T8": (8, 32, 8, 128, 128, False, 0.0, False, (torch.bfloat16, torch.float16)),
    "qwen3-next gated T4": (4, 16, 2, 256, 64, True, 1.0, True, ALL),
    "partial d64 rot16 T33": (33, 6, 3, 64, 16, True, 0.0, False, (torch.bfloat16,)),
}
if OPTS.interpret:
    PREP_CASES = {"tiny T3": (3, 4, 2, 64, 64, True, 0.0, False, ALL),
                  "tiny gated T4": (4, 4, 2, 64, 16, True, 1.0, True, (torch.float16,)),
                  "tiny no-norm T2": (2, 2, 2, 32, 32, False, 0.0, False, (torch.float32,))}


def prep_inputs(case, dtype, seed):
    t, hq, hkv, d, rot, norm, _, gated, _ = PREP_CASES[case]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    page = 16
    nblocks = t // page + 8
    qw = 2 * d if gated else d
    qkv = torch.randn(t, hq * qw + 2 * hkv * d, generator=gen, device=DEV).to(dtype)
    q = qkv[:, :hq * qw].view(t, hq, qw)[..., :d]
    k = qkv[:, hq * qw:hq * qw + hkv * d].view(t, hkv, d)
    v = qkv[:, hq * qw + hkv * d:].view(t, hkv, d)
    pos = torch.randint(0, 8192, (t,), generator=gen, device=DEV)
    slots = torch.randperm(nblocks * page, generator=gen, device=DEV)[:t]
    slots[torch.arange(t, device=DEV) % 5 == 3] = -1
    weights = [(torch.rand(d, generator=gen, device=DEV) + 0.5).to(dtype) for _ in range(2)] if norm else [None, None]
    inv_freq, factor = rope_inv_freq(rot, 1e6, None)
    table = rope_cos_sin_cache(inv_freq, 8192, factor).to(DEV)
    kc = torch.full((nblocks, page, hkv, d), float("nan"), dtype=dtype, device=DEV)
    return q, k, v, pos, table, kc, kc.clone(), slots, weights


def check_prep(case, dtype, seed):
    *_, offset, _, _ = PREP_CASES[case]
    q, k, v, pos, table, kc, vc, slots, (qw, kw) = prep_inputs(case, dtype, seed)
    okc, ovc = kc.float().nan_to_num(0), vc.float().nan_to_num(0)
    fw = [w.float() if w is not None else None for w in (qw, kw)]
    oq = qk_norm_rope_store_ref(q.float(), k.float(), v.float(), pos, table, okc, ovc, slots, *fw, 1e-6, offset)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEV)
    qk_norm_rope_store_triton(q, k, v, pos, table, kc, vc, slots, qw, kw, 1e-6, offset, q_out=out)
    written = slots[slots >= 0]
    errs = [rel_err(out, oq)]
    untouched_ok = True
    for cache, oracle in ((kc, okc), (vc, ovc)):
        flat, oflat = cache.flatten(0, 1), oracle.flatten(0, 1)
        errs.append(rel_err(flat[written], oflat[written]))
        mask = torch.ones(flat.shape[0], dtype=torch.bool, device=DEV)
        mask[written] = False
        untouched_ok &= bool(flat[mask].isnan().all())
    ok = max(errs) <= TOL[dtype] and untouched_ok
    if not ok:
        FAILED.append(f"prep {case} {SHORT[dtype]} seed {seed}")
    return ok, max(errs)


def time_prep(case):
    t, hq, hkv, d, _, norm, offset, _, _ = PREP_CASES[case]
    q, k, v, pos, table, kc, vc, slots, (qw, kw) = prep_inputs(case, torch.bfloat16, 99)
    slots = slots.abs()
    out = torch.empty(q.shape, dtype=q.dtype, device=DEV)
    fused = graph_us(lambda i: qk_norm_rope_store_triton(q, k, v, pos, table, kc, vc, slots, qw, kw, 1e-6, offset,
                                                          q_out=out), 20)

    def separate(i):  # what the layer ran before: q norm, k norm, rope (in place), store
        qn, kn = (rms_norm_triton(q, qw, 1e-6, offset), rms_norm_triton(k, kw, 1e-6, offset)) if norm else (q, k)
        apply_rope_triton(qn, kn, pos, table)
        store_kv_triton(kn, v, kc, vc, slots)

    sep = graph_us(separate, 20)
    # Fewest bytes: q, k, v read once, q written, k and v written to the cache.
    nbytes = (2 * t * hq * d + 3 * t * hkv * d) * q.element_size()
    return fused, sep, nbytes


# ---------------------------------------------------------------- decode GEMV

GEMV_SHAPES = {"qkv 6144x4096": (6144, 4096), "o 4096x4096": (4096, 4096), "gate_up 24576x4096": (24576, 4096),
               "down 4096x12288": (4096, 12288), "lm_head 151936x4096": (151936, 4096)}
GEMV_MS = tuple(int(m) for m in OPTS.ms.split(","))
if OPTS.interpret:
    GEMV_SHAPES = {"tiny 48x256": (48, 256), "tiny 40x200": (40, 200)}
    GEMV_MS = (1, 3)


def gemv_dtype(cfg):
    return torch.float16 if (OPTS.interpret and cfg.dot) else torch.bfloat16


def check_config(x, w, cfg, ref, ws):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=DEV)
    gemv(x, w, None, cfg, ws, out=out)
    err = rel_err(out, ref)
    stable = True
    for _ in range(3 if BENCH else 1):  # split-K: the reduction order is fixed, so reruns are bitwise equal
        again = torch.full_like(out, float("nan"))
        gemv(x, w, None, cfg, ws, out=again)
        stable &= bool(torch.equal(again, out))
    return err, stable


def bench_shape(name, n, k, copy_bw, l2):
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count if BENCH else 132
    wbytes = n * k * 2
    copies = max(1, math.ceil(3 * l2 / wbytes)) if BENCH else 1
    gen = torch.Generator(device=DEV).manual_seed(n + k)
    w32 = [(torch.randn(n, k, generator=gen, device=DEV) / k ** 0.5) for _ in range(copies)]
    by_dtype = {dt: [w.to(dt) for w in w32] for dt in {gemv_dtype(c) for c in candidate_configs(1, n, k, sms)}}
    del w32
    wb = by_dtype[torch.bfloat16]
    for m in GEMV_MS:
        x32 = torch.randn(m, k, generator=gen, device=DEV)
        refs = {dt: F.linear(x32.to(dt).float(), ws[0].float()) for dt, ws in by_dtype.items()}
        row = {"shape": name, "m": m, "configs": []}
        for cfg in candidate_configs(m, n, k, sms):
            dtype = gemv_dtype(cfg)
            x, weights = x32.to(dtype), by_dtype[dtype]
            ws = new_workspace(m, n, cfg, DEV) if cfg.split_k > 1 else None
            err, stable = check_config(x, weights[0], cfg, refs[dtype], ws)
            ok = err <= TOL[dtype] and stable
            if not ok:
                FAILED.append(f"gemv {name} m{m} {cfg.label()} err={err:.2e} stable={stable}")
            entry = {"config": cfg.label(), "err": err, "stable": stable, "ok": ok}
            if BENCH:
                out = torch.empty(m, n, dtype=dtype, device=DEV)
                entry["us"] = graph_us(lambda i, cfg=cfg, ws=ws, x=x, out=out, weights=weights:
                                       gemv(x, weights[i % copies], None, cfg, ws, out=out), 4 * copies)
            row["configs"].append(entry)
        if BENCH:
            xb = x32.to(torch.bfloat16)
            row["cublas_us"] = graph_us(lambda i, xb=xb: F.linear(xb, wb[i % copies]), 4 * copies)
            disp = GemvDispatcher(enabled=True)
            y = disp(xb, wb[0])
            if rel_err(y, refs[torch.bfloat16]) > TOL[torch.bfloat16]:
                FAILED.append(f"gemv dispatcher {name} m{m}")
            picked = next(iter(disp.configs.values())).label() if disp.configs else "heuristic (tuning failed)"
            row["dispatcher_pick"] = picked
            row["dispatcher_us"] = graph_us(lambda i, xb=xb, disp=disp: disp(xb, wb[i % copies]), 4 * copies)
            good = [c for c in row["configs"] if c["ok"]]
            best = min(good, key=lambda c: c["us"]) if good else None
            nbytes = wbytes + 2 * m * (k + n)
            row.update(best=best["config"] if best else None, best_us=best["us"] if best else float("nan"),
                       bytes=nbytes)
            row["best_gbs"] = nbytes / row["best_us"] / 1e3
            row["cublas_gbs"] = nbytes / row["cublas_us"] / 1e3
            row["best_frac_copy"] = row["best_gbs"] * 1e9 / copy_bw
            print(f"gemv {name:22s} M={m:2d} best {row['best']:28s} {row['best_us']:8.1f} us "
                  f"{row['best_gbs']:6.0f} GB/s ({100 * row['best_frac_copy']:4.1f}% of copy) | cuBLAS "
                  f"{row['cublas_us']:8.1f} us {row['cublas_gbs']:6.0f} GB/s | dispatcher {picked} "
                  f"{row['dispatcher_us']:.1f} us", flush=True)
        else:
            print(f"gemv {name} M={m}: {sum(c['ok'] for c in row['configs'])}/{len(row['configs'])} configs ok",
                  flush=True)
        RESULT["gemv"].append(row)
    if BENCH:
        torch.cuda.empty_cache()


def measure_copy_bw() -> float:
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    t_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * (1 << 30) / (t_ms * 1e-3)


def main() -> int:
    start = time.perf_counter()
    copy_bw, l2 = (measure_copy_bw(), torch.cuda.get_device_properties(DEV).L2_cache_size) if BENCH else (1.0, 1)
    if BENCH:
        print(f"device {torch.cuda.get_device_name(DEV)}, copy {copy_bw / 1e9:.0f} GB/s, L2 {l2 >> 20} MiB")
        RESULT.update(device=torch.cuda.get_device_name(DEV), copy_GBs=copy_bw / 1e9)
    for case, spec in ({} if OPTS.gemv_only else PREP_CASES).items():
        for dtype in spec[-1]:
            results = [check_prep(case, dtype, seed) for seed in range(3)]
            ok, err = all(r[0] for r in results), max(r[1] for r in results)
            row = {"case": case, "dtype": SHORT[dtype], "err": err, "ok": ok}
            if BENCH and dtype == torch.bfloat16:
                row["fused_us"], row["separate_us"], row["bytes"] = time_prep(case)
            RESULT["prep"].append(row)
            print(f"{'ok  ' if ok else 'FAIL'} prep {case:24s} {SHORT[dtype]} err={err:.2e}"
                  + (f" fused {row['fused_us']:.1f} us vs separate {row['separate_us']:.1f} us "
                     f"({row['bytes'] / row['fused_us'] / 1e3:.0f} GB/s)" if "fused_us" in row else ""), flush=True)
    for name, (n, k) in GEMV_SHAPES.items():
        if time.perf_counter() - start > OPTS.budget_s:  # stay inside the budget: say what was left out
            FAILED.append(f"not run (time budget): gemv {name}")
            continue
        bench_shape(name, n, k, copy_bw, l2)
    wall = time.perf_counter() - start
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_kernel_bench.json").write_text(json.dumps(RESULT, indent=1, default=str))
    print(f"\n==== summary ({wall:.0f} s) ====")
    for row in RESULT["prep"]:
        if "fused_us" in row:
            print(f"prep {row['case']:24s} fused {row['fused_us']:7.1f} us  separate {row['separate_us']:7.1f} us  "
                  f"x{row['separate_us'] / row['fused_us']:.2f}")
    if BENCH:
        print(f"{'gemv shape':22s} {'M':>3s} {'best us':>8s} {'GB/s':>6s} {'%copy':>6s} {'cuBLAS us':>9s} "
              f"{'speedup':>7s} {'disp us':>8s}  best config")
        for r in RESULT["gemv"]:
            print(f"{r['shape']:22s} {r['m']:3d} {r['best_us']:8.1f} {r['best_gbs']:6.0f} "
                  f"{100 * r['best_frac_copy']:6.1f} {r['cublas_us']:9.1f} {r['cublas_us'] / r['best_us']:7.2f} "
                  f"{r['dispatcher_us']:8.1f}  {r['best']}")
    print("FAILED:\n  " + "\n  ".join(FAILED) if FAILED else "all checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
