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
    python scripts/fp8_gpu_bench.py --quick --sweep   # + every GEMV variant/tile (GEMV_SWEEP) at M = 1,
        # the prefill paths with the fused quantization, and torch's blockwise _scaled_mm (<= 120 s)

Writes $OUT/fp8_gpu_bench.json when OUT is set. Exits 1 on any failed check.
"""
# ruff: noqa: B023  (every timed lambda runs inside its loop iteration, before the variables move on)
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--interpret", action="store_true")
ARGS.add_argument("--quick", action="store_true")
ARGS.add_argument("--sweep", action="store_true", help="time every GEMV config and the fused-quant prefill paths")
OPTS = ARGS.parse_args()
START = time.monotonic()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

if OPTS.interpret:
    from lamina.kernels.interpreter import patch_triton_interpreter

    patch_triton_interpreter()

from gpu_timing import rel_err, time_us  # noqa: E402  (scripts/ is on sys.path: this file runs as a script)

from lamina.kernels.fp8 import (
    FP8,
    _scaled_mm_rows,
    block_scaled_mm,
    dequantize,
    expand_block_scale,
    quantize_blocks,
    quantize_rows,
    quantize_tokens,
)
from lamina.kernels.triton_fp8_gemm import fp8_block_gemm
from lamina.kernels.triton_fp8_gemv import GemvConfig, default_config, fp8_gemv
from lamina.kernels.triton_fp8_quant import quantize_tokens_triton

DEV = torch.device("cpu" if OPTS.interpret else "cuda")
BENCH = not OPTS.interpret
FAILED: list[str] = []
RESULT: dict = {"peaks": {}, "gemv": [], "prefill": [], "kv": [], "gemv_sweep": [], "decode_step_estimate": {}}
# The --sweep GEMV configs at M = 1 (fma tiles wider than a 128-row scale block are skipped for block scales).
GEMV_SWEEP = [GemvConfig("dot", 16), GemvConfig("dot", 64), GemvConfig("dot16", 16), GemvConfig("dot16", 64),
              GemvConfig("fma", 8, 512, 4), GemvConfig("fma", 16, 512, 4), GemvConfig("fma", 8, 1024, 4),
              GemvConfig("fma", 16, 1024, 8), GemvConfig("fma", 8, 2048, 8), GemvConfig("fma", 32, 256, 8),
              GemvConfig("fmasum", 8, 512, 4), GemvConfig("fmasum", 8, 1024, 4), GemvConfig("fmasum", 16, 512, 8)]
GEMV_SWEEP_M4 = [GemvConfig("dot", 16), GemvConfig("dot16", 16), GemvConfig("fma", 8, 256, 4),
                 GemvConfig("fma", 16, 256, 8), GemvConfig("fma", 8, 512, 8), GemvConfig("fmasum", 8, 512, 4),
                 GemvConfig("fmasum", 16, 512, 8)]
SWEEP_SECONDS = 75.0  # the sweep stops timing new configs past this (the whole run must stay under 120 s)
LAYERS = 36  # Qwen3-8B: the decode-step estimate is 36 x the four projections' M = 1 times
# Qwen3-8B projections (N, K): fused q|k|v, o, fused gate|up, down.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
if OPTS.interpret:
    SHAPES = {"tiny": (256, 256)}


def check(label: str, err: float, tol: float) -> None:
    ok = err < tol
    print(f"  {'ok ' if ok else 'FAIL'} {label}: rel err {err:.2e} (tol {tol:.0e})")
    if not ok:
        FAILED.append(label)


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
        quick_ms = (1, 4, 16) if OPTS.sweep else (1, 16)
        for m in (quick_ms if OPTS.quick else (1, 2, 4, 8, 16)) if BENCH else (1, 3):
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16 if BENCH else torch.float16)
            row = {"shape": name, "n": n, "k": k, "m": m}
            if BENCH:
                wbs = [wb.clone() for _ in range(copies)]
                row["bf16_us"] = time_us(lambda i: F.linear(x, wbs[i]), copies)
            for sname, (block, q, s) in schemes.items():
                ref = x.double() @ dequantize(q, s, block).double().T
                check(f"gemv {name} m{m} {sname}", rel_err(fp8_gemv(x, q, s, block), ref), 1e-2)
                if not BENCH:
                    if OPTS.sweep:
                        sweep_gemv(name, x, q, s, block, ref, [(q, s)], 1)
                    continue
                qs = [(q.clone(), s.clone()) for _ in range(copies)]
                times = {bn: time_us(lambda i, bn=bn: fp8_gemv(x, qs[i][0], qs[i][1], block, block_n=bn), copies)
                         for bn in (() if OPTS.quick else (16, 32, 64))}
                times["default"] = time_us(lambda i: fp8_gemv(x, qs[i][0], qs[i][1], block), copies)
                row[f"{sname}_us"] = times
                row[f"{sname}_default_config"] = label(default_config(m, n, k, block, DEV))
                if OPTS.sweep and m in (1, 4):
                    row[f"{sname}_sweep_us"] = sweep_gemv(name, x, q, s, block, ref, qs, copies)
                row[f"{sname}_speedup_vs_bf16"] = row["bf16_us"] / times["default"]
                row[f"{sname}_GBs"] = n * k / times["default"] / 1e3
            RESULT["gemv"].append(row)
            if BENCH:
                print(f"  {name} m{m}: bf16 {row['bf16_us']:.1f} us, fp8 rows {row['rows_us']['default']:.1f} us "
                      f"({row['rows_speedup_vs_bf16']:.2f}x), block {row['block128_us']['default']:.1f} us "
                      f"({row['block128_speedup_vs_bf16']:.2f}x)")


def label(c: GemvConfig) -> str:
    return f"{c.variant}/n{c.block_n}/k{c.block_k or 'def'}/w{c.num_warps}"


def sweep_gemv(name, x, q, s, block, ref, qs, copies) -> dict:
    """Every GEMV_SWEEP config (GEMV_SWEEP_M4 above M = 1): checked against the fp64 oracle, then timed with
    cold weights (GPU)."""
    out = {}
    for c in GEMV_SWEEP if x.shape[0] == 1 else GEMV_SWEEP_M4:
        if c.variant in ("fma", "fmasum") and block is not None and c.block_n > block[0]:
            continue
        if BENCH and time.monotonic() - START > SWEEP_SECONDS:
            out[label(c)] = "skipped: past SWEEP_SECONDS"
            continue
        try:
            err = rel_err(fp8_gemv(x, q, s, block, config=c), ref)
        except Exception as e:  # a config the compiler refuses (registers, shared memory) is reported, not fatal
            out[label(c)] = f"error: {type(e).__name__}: {str(e)[:120]}"
            continue
        check(f"gemv sweep {name} {label(c)} {'rows' if block is None else 'block'}", err, 1e-2)
        if BENCH:
            out[label(c)] = time_us(lambda i, c=c: fp8_gemv(x, qs[i][0], qs[i][1], block, config=c), copies)
    return out


def decode_step_estimate() -> None:
    """36 x the four projections at M = 1 (the real step is scripts/gpu_wq_bench.py's CUDA graph): bf16, the
    heuristic, and the best swept config per shape; TB/s of weight bytes streamed."""
    rows = [r for r in RESULT["gemv"] if r["m"] == 1]
    if len(rows) != len(SHAPES):
        return
    fp8_bytes = LAYERS * sum(r["n"] * r["k"] for r in rows)
    est = {"bf16_us": LAYERS * sum(r["bf16_us"] for r in rows)}
    for sname in ("rows", "block128"):
        est[f"{sname}_default_us"] = LAYERS * sum(r[f"{sname}_us"]["default"] for r in rows)
        sweeps = [{k: v for k, v in r.get(f"{sname}_sweep_us", {}).items() if isinstance(v, float)} for r in rows]
        if all(sweeps):
            est[f"{sname}_best_us"] = LAYERS * sum(min(sw.values()) for sw in sweeps)
            est[f"{sname}_best_configs"] = {r["shape"]: min(sw, key=sw.get) for r, sw in zip(rows, sweeps)}
        for key in (f"{sname}_default_us", f"{sname}_best_us"):
            if key in est:
                est[key.replace("_us", "_speedup_vs_bf16")] = est["bf16_us"] / est[key]
                est[key.replace("_us", "_TBs")] = fp8_bytes / est[key] / 1e6
    RESULT["decode_step_estimate"] = est
    print("decode step estimate (36 x M=1 projections): " + json.dumps(
        {k: (round(v, 2) if isinstance(v, float) else v) for k, v in est.items()}))


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
        qr, sr = quantize_rows(w)
        check_fused_paths(name, x[:200] if BENCH else x[:37], q, s, qr, sr)
        if not BENCH:
            continue
        flops = 2 * m * n * k
        wb = w.to(torch.bfloat16)
        row = {"shape": name, "m": m, "n": n, "k": k,
               "bf16_us": time_us(lambda i: F.linear(x, wb), reps=10),
               "block_gemm_us": time_us(lambda i: fp8_block_gemm(xq, xs, q, s, (128, 128), x.dtype), reps=10),
               "block_with_quant_us": time_us(lambda i: fp8_block_gemm(*quantize_tokens(x, group=128), q, s,
                                                                       (128, 128), x.dtype), reps=10),
               "rows_scaled_mm_with_quant_us": time_us(lambda i: _rows_mm(x, qr, sr), reps=10)}
        # The fused-quantization paths fp8_linear now runs (triton_fp8_quant), and torch's blockwise GEMM.
        row["quant_torch_group128_us"] = time_us(lambda i: quantize_tokens(x, group=128), reps=10)
        row["quant_triton_group128_us"] = time_us(lambda i: quantize_tokens_triton(x, 128), reps=10)
        row["quant_triton_token_us"] = time_us(lambda i: quantize_tokens_triton(x, pad_m=16), reps=10)
        row["block_fused_quant_us"] = time_us(lambda i: block_scaled_mm(x, q, s, (128, 128)), reps=10)
        row["rows_fused_quant_us"] = time_us(lambda i: _scaled_mm_rows(x, qr, sr, None, None), reps=10)
        if BLOCKWISE_OK:
            row["block_torch_scaled_mm_us"] = time_us(lambda i: block_scaled_mm(x, q, s, (128, 128), None,
                                                                                  "scaled_mm"), reps=10)
        for key in [k for k in row if k.endswith("_us") and not k.startswith("quant_")]:
            row[key.replace("_us", "_tflops")] = flops / row[key] / 1e6
        if peak:
            row["block_gemm_mfu_vs_fp8_peak"] = row["block_gemm_tflops"] / peak
            row["block_with_quant_mfu_vs_fp8_peak"] = row["block_with_quant_tflops"] / peak
        RESULT["prefill"].append(row)
        print(f"  prefill {name}: bf16 {row['bf16_tflops']:.0f}, block gemm {row['block_gemm_tflops']:.0f} "
              f"(+quant {row['block_with_quant_tflops']:.0f}), rows _scaled_mm+quant "
              f"{row['rows_scaled_mm_with_quant_tflops']:.0f} TFLOPS; fused quant: block "
              f"{row['block_fused_quant_tflops']:.0f}, rows {row['rows_fused_quant_tflops']:.0f}, torch blockwise "
              f"{row.get('block_torch_scaled_mm_tflops', 0):.0f}; quant 8k x {k}: torch "
              f"{row['quant_torch_group128_us']:.0f} us, triton {row['quant_triton_group128_us']:.0f} us")


BLOCKWISE_OK: list[str] = []  # set (once) when torch's blockwise _scaled_mm ran and matched


def check_fused_paths(name, x, q, s, qr, sr) -> None:
    """fp8_linear's CUDA prefill paths on a ragged M (padding) vs the fp64 matmul of the torch-quantized
    activations: block scales through the fused quantization + Triton GEMM, row scales through _scaled_mm, and
    torch's blockwise _scaled_mm (1x128 x 128x128), whose scale layouts are probed here (errors reported)."""
    m, k = x.shape
    xq, xs = quantize_tokens(x, group=128)
    ref = (xq.double() * expand_block_scale(xs, (m, k), (1, 128)).double()) @ dequantize(q, s, (128, 128)).double().T
    check(f"block fused quant {name} m{m}", rel_err(block_scaled_mm(x, q, s, (128, 128)), ref), 1e-2)
    xq, xs = quantize_tokens(x)
    ref_rows = (xq.double() * xs.double()) @ dequantize(qr, sr, None).double().T
    if BENCH:  # torch._scaled_mm on CUDA (the CPU run takes the reference path, checked by the tests)
        check(f"rows fused quant {name} m{m}", rel_err(_scaled_mm_rows(x, qr, sr, None, None), ref_rows), 1e-2)
        try:
            err = rel_err(block_scaled_mm(x, q, s, (128, 128), None, "scaled_mm"), ref)
            print(f"  torch blockwise _scaled_mm {name}: rel err {err:.2e}")
            if err < 1e-2 and not BLOCKWISE_OK:
                BLOCKWISE_OK.append(name)
            RESULT.setdefault("blockwise_scaled_mm", {})[name] = err
        except Exception as e:  # not supported by this torch/GPU, or another scale layout wanted
            RESULT.setdefault("blockwise_scaled_mm", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  torch blockwise _scaled_mm {name}: {type(e).__name__}: {str(e)[:300]}")
        if name == next(iter(SHAPES)):
            probe_blockwise_layouts(x, q, s, ref)


def probe_blockwise_layouts(x, q, s, ref) -> None:
    """Which scale layouts torch._scaled_mm's blockwise mode takes (1x128 activations: M- or K-major scales;
    128x128 weights: the stored scales transposed as a view or copied), and whether M needs padding."""
    out = {}
    for pad in (16, 1):
        for a_major in (True, False):
            xq, xs = quantize_tokens_triton(x, group=128, pad_m=pad, scales_m_major=a_major)
            for b_copy in (False, True):
                sb = s.t().contiguous() if b_copy else s.t()
                key = f"pad{pad}/a_{'m' if a_major else 'k'}_major/b_{'copy' if b_copy else 'view'}"
                try:
                    y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=sb, out_dtype=torch.bfloat16)[:x.shape[0]]
                    out[key] = rel_err(y, ref)
                except Exception as e:
                    out[key] = f"{type(e).__name__}: {str(e)[:160]}"
    RESULT["blockwise_layouts"] = out
    print("  blockwise _scaled_mm layouts: " + json.dumps(out))


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


def batch_cases() -> None:
    """Large decode batches (the 256-request offline run's steps: M = 64 and 256, weights cold): bf16
    F.linear vs fp8_linear's M > 16 paths (row scales: fused quantization + _scaled_mm, what online FP8
    runs; block scales: fused quantization + the Triton GEMM or torch's blockwise _scaled_mm, the sm90 default)."""
    RESULT["batch"] = []
    est: dict = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=DEV) * 0.02
        copies = max(1, -(-256 * 2**20 // (n * k * 2)))
        wbs = [w.to(torch.bfloat16) for _ in range(copies)]
        rows = [quantize_rows(w) for _ in range(copies)]
        blocks = [quantize_blocks(w, (128, 128)) for _ in range(copies)]
        for m in (64, 256):
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            row = {"shape": name, "m": m, "n": n, "k": k,
                   "bf16_us": time_us(lambda i: F.linear(x, wbs[i]), copies),
                   "rows_fused_quant_us": time_us(lambda i: _scaled_mm_rows(x, *rows[i], None, None), copies),
                   "rows_torch_quant_us": time_us(lambda i: _rows_mm(x, *rows[i]), copies),
                   "block_fused_quant_us": time_us(lambda i: block_scaled_mm(x, *blocks[i], (128, 128)), copies),
                   "block_scaled_mm_us": time_us(
                       lambda i: block_scaled_mm(x, *blocks[i], (128, 128), gemm="scaled_mm"), copies)}
            RESULT["batch"].append(row)
            for key in row:
                if key.endswith("_us"):
                    est[f"m{m}_{key}"] = est.get(f"m{m}_{key}", 0.0) + LAYERS * row[key]
            print(f"  batch {name} m{m}: " + ", ".join(f"{k_} {v:.1f}" for k_, v in row.items() if k_.endswith("_us")))
    RESULT["batch_step_estimate"] = est  # 36 x the four projections, per decode step
    print("batch step estimate (us): " + json.dumps({k: round(v) for k, v in est.items()}))


def main() -> int:
    torch.manual_seed(0)
    if BENCH:
        peaks()
    print("decode GEMV")
    gemv_cases()
    if BENCH:
        decode_step_estimate()
    dump()
    print("prefill GEMM")
    prefill_cases()
    dump()
    if BENCH:
        print("decode batches (M > 16)")
        batch_cases()
        dump()
    print("FP8 KV attention")
    kv_cases()
    dump()
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
