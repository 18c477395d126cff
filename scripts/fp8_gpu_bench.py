#!/usr/bin/env python3
"""Checks and times the FP8 kernels on the GPU (one call, a few minutes on an H200):

1. peaks: a large bf16 matmul and a large FP8 torch._scaled_mm (the FP8 tensor-core peak the prefill MFU
   is measured against);
2. decode GEMV (triton_fp8_gemv) on the Qwen3-8B projections at M = 1..16, row and 128x128 block scales,
   checked against the dequantized fp64 matmul, timed against bf16 F.linear with weights cold (copies
   rotated past the L2) for each BLOCK_N and the default;
3. prefill at 8192 tokens: activation quantization + the block-scaled Triton GEMM, and per-token
   quantization + _scaled_mm (row scales), against bf16 F.linear: TFLOPS and MFU against the FP8 peak;
4. FP8 KV: the decode attention kernel over bf16 vs FP8 caches (64 sequences x 4096 tokens, Qwen3-8B heads),
   checked against the reference on the same FP8 cache.

    python scripts/fp8_gpu_bench.py               # CUDA
    python scripts/fp8_gpu_bench.py --interpret   # CPU: tiny shapes through TRITON_INTERPRET=1, checks only
    python scripts/fp8_gpu_bench.py --quick       # GEMV at M = 1 and 16 with the default BLOCK_N only

Writes $OUT/fp8_gpu_bench.json when OUT is set. Exits 1 on any failed check.
"""
# ruff: noqa: B023  (every timed lambda runs inside its loop iteration, before the variables move on)
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--interpret", action="store_true")
ARGS.add_argument("--quick", action="store_true")
OPTS = ARGS.parse_args()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

if OPTS.interpret:
    from lamina.kernels.interpreter import patch_triton_interpreter

    patch_triton_interpreter()

from lamina.kernels.fp8 import FP8, dequantize, expand_block_scale, quantize_blocks, quantize_rows, quantize_tokens
from lamina.kernels.triton_fp8_gemm import fp8_block_gemm
from lamina.kernels.triton_fp8_gemv import fp8_gemv

DEV = torch.device("cpu" if OPTS.interpret else "cuda")
BENCH = not OPTS.interpret
FAILED: list[str] = []
RESULT: dict = {"peaks": {}, "gemv": [], "prefill": [], "kv": []}
# Qwen3-8B projections (N, K): fused q|k|v, o, fused gate|up, down.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
if OPTS.interpret:
    SHAPES = {"tiny": (256, 256)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(label: str, err: float, tol: float) -> None:
    ok = err < tol
    print(f"  {'ok ' if ok else 'FAIL'} {label}: rel err {err:.2e} (tol {tol:.0e})")
    if not ok:
        FAILED.append(label)


def time_us(fn, copies: int = 1, reps: int = 20) -> float:
    """Median microseconds of fn(i) over CUDA-graph replays of `copies` calls (i rotates weight copies so
    each call reads them cold)."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / copies)
    return sorted(samples)[len(samples) // 2]


def peaks() -> None:
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    bf16 = 2 * n**3 / time_us(lambda i: a @ b, reps=10) / 1e6
    a8, b8 = a.to(FP8), b.to(FP8)
    one = torch.ones((), device=DEV)
    fp8 = 2 * n**3 / time_us(lambda i: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                          out_dtype=torch.bfloat16), reps=10) / 1e6
    RESULT["peaks"] = {"bf16_tflops": bf16, "fp8_tflops": fp8}
    print(f"peaks: bf16 {bf16:.0f} TFLOPS, fp8 {fp8:.0f} TFLOPS (8192^3)")


def gemv_cases() -> None:
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=DEV) * 0.02
        schemes = {"rows": (None, *quantize_rows(w)), "block128": ((128, 128), *quantize_blocks(w, (128, 128)))}
        wb = w.to(torch.bfloat16)
        copies = max(1, -(-256 * 2**20 // (n * k * 2))) if BENCH else 1  # > 2x the L2 in bf16 weights
        for m in ((1, 16) if OPTS.quick else (1, 2, 4, 8, 16)) if BENCH else (1, 3):
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16 if BENCH else torch.float16)
            row = {"shape": name, "n": n, "k": k, "m": m}
            if BENCH:
                wbs = [wb.clone() for _ in range(copies)]
                row["bf16_us"] = time_us(lambda i: F.linear(x, wbs[i]), copies)
            for sname, (block, q, s) in schemes.items():
                ref = x.double() @ dequantize(q, s, block).double().T
                check(f"gemv {name} m{m} {sname}", rel_err(fp8_gemv(x, q, s, block), ref), 1e-2)
                if not BENCH:
                    continue
                qs = [(q.clone(), s.clone()) for _ in range(copies)]
                times = {bn: time_us(lambda i, bn=bn: fp8_gemv(x, qs[i][0], qs[i][1], block, block_n=bn), copies)
                         for bn in (() if OPTS.quick else (16, 32, 64))}
                times["default"] = time_us(lambda i: fp8_gemv(x, qs[i][0], qs[i][1], block), copies)
                row[f"{sname}_us"] = times
                row[f"{sname}_speedup_vs_bf16"] = row["bf16_us"] / times["default"]
                row[f"{sname}_GBs"] = n * k / times["default"] / 1e3
            RESULT["gemv"].append(row)
            if BENCH:
                print(f"  {name} m{m}: bf16 {row['bf16_us']:.1f} us, fp8 rows {row['rows_us']['default']:.1f} us "
                      f"({row['rows_speedup_vs_bf16']:.2f}x), block {row['block128_us']['default']:.1f} us "
                      f"({row['block128_speedup_vs_bf16']:.2f}x)")


def prefill_cases() -> None:
    m = 8192 if BENCH else 40
    peak = RESULT["peaks"].get("fp8_tflops")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=DEV) * 0.02
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16 if BENCH else torch.float16)
        q, s = quantize_blocks(w, (128, 128))
        xq, xs = quantize_tokens(x, group=128)
        a = xq.double() * expand_block_scale(xs, (m, k), (1, 128)).double()
        ref = a @ dequantize(q, s, (128, 128)).double().T
        tiles = None if BENCH else (16, 32, 2, 4, 1)
        check(f"block gemm {name} m{m}", rel_err(fp8_block_gemm(xq, xs, q, s, (128, 128), x.dtype, tiles=tiles),
                                                 ref), 1e-2)
        if not BENCH:
            continue
        flops = 2 * m * n * k
        wb = w.to(torch.bfloat16)
        qr, sr = quantize_rows(w)
        row = {"shape": name, "m": m, "n": n, "k": k,
               "bf16_us": time_us(lambda i: F.linear(x, wb), reps=10),
               "block_gemm_us": time_us(lambda i: fp8_block_gemm(xq, xs, q, s, (128, 128), x.dtype), reps=10),
               "block_with_quant_us": time_us(lambda i: fp8_block_gemm(*quantize_tokens(x, group=128), q, s,
                                                                       (128, 128), x.dtype), reps=10),
               "rows_scaled_mm_with_quant_us": time_us(lambda i: _rows_mm(x, qr, sr), reps=10)}
        for key in ("bf16_us", "block_gemm_us", "block_with_quant_us", "rows_scaled_mm_with_quant_us"):
            row[key.replace("_us", "_tflops")] = flops / row[key] / 1e6
        if peak:
            row["block_gemm_mfu_vs_fp8_peak"] = row["block_gemm_tflops"] / peak
            row["block_with_quant_mfu_vs_fp8_peak"] = row["block_with_quant_tflops"] / peak
        RESULT["prefill"].append(row)
        print(f"  prefill {name}: bf16 {row['bf16_tflops']:.0f}, block gemm {row['block_gemm_tflops']:.0f} "
              f"(+quant {row['block_with_quant_tflops']:.0f}), rows _scaled_mm+quant "
              f"{row['rows_scaled_mm_with_quant_tflops']:.0f} TFLOPS")


def _rows_mm(x, q, s):
    xq, xs = quantize_tokens(x)
    return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=x.dtype)


def kv_cases() -> None:
    from lamina.kernels.attention import AttentionMetadata, paged_attention_ref
    from lamina.kernels.triton_attention import paged_attention_triton

    b, ctx, hq, hkv, d, page = (64, 4096, 32, 8, 128, 16) if BENCH else (2, 48, 4, 2, 64, 16)
    nb = b * ctx // page
    tables = torch.arange(nb, device=DEV, dtype=torch.int32).view(b, -1)
    meta = AttentionMetadata(torch.zeros(b, dtype=torch.int64, device=DEV),
                             torch.arange(b + 1, dtype=torch.int32, device=DEV),
                             torch.full((b,), ctx, dtype=torch.int32, device=DEV), tables, list(range(b + 1)),
                             [ctx] * b, 1, ctx)
    dtype = torch.bfloat16 if BENCH else torch.float16
    q = torch.randn(b, hq, d, device=DEV).to(dtype)
    kc = torch.randn(nb, page, hkv, d, device=DEV).to(dtype)
    vc = torch.randn(nb, page, hkv, d, device=DEV).to(dtype)
    k8, v8 = kc.to(FP8), vc.to(FP8)
    ref = paged_attention_ref(q.float(), k8.float(), v8.float(), meta, d**-0.5)
    check("decode attention fp8 cache", rel_err(paged_attention_triton(q, k8, v8, meta, d**-0.5), ref), 1e-2)
    if BENCH:
        row = {"batch": b, "context": ctx,
               "bf16_us": time_us(lambda i: paged_attention_triton(q, kc, vc, meta, d**-0.5)),
               "fp8_us": time_us(lambda i: paged_attention_triton(q, k8, v8, meta, d**-0.5))}
        row["speedup"] = row["bf16_us"] / row["fp8_us"]
        RESULT["kv"].append(row)
        print(f"  decode attention b{b} ctx{ctx}: bf16 cache {row['bf16_us']:.0f} us, fp8 cache "
              f"{row['fp8_us']:.0f} us ({row['speedup']:.2f}x)")


def dump() -> None:
    """$OUT/fp8_gpu_bench.json, rewritten after every stage (a run cut off at its time limit keeps what it did)."""
    RESULT["failed"] = FAILED
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8_gpu_bench.json").write_text(json.dumps(RESULT, indent=1))


def main() -> int:
    torch.manual_seed(0)
    if BENCH:
        peaks()
    print("decode GEMV")
    gemv_cases()
    dump()
    print("prefill GEMM")
    prefill_cases()
    dump()
    print("FP8 KV attention")
    kv_cases()
    dump()
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
