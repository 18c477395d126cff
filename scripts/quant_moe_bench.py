#!/usr/bin/env python3
"""Checks and times the grouped MoE GEMMs over quantized experts against the bf16 grouped GEMM (one call,
about a minute on an H200):

- shapes: Qwen3-30B-A3B experts (E 128, top-8, H 2048, I 768) and Qwen3-Next-80B-A3B (E 512, top-10,
  H 2048, I 512), 1,024 and 8,192 tokens, softmax top-k routing of random logits;
- paths: bf16 `fused_moe_triton`; FP8 128x128 block scales and FP8 row scales through
  `fp8_moe_grouped`; W4A16 group 128 through `wq_moe_grouped`; and what FP8 prefill did before the grouped
  kernel (dequantize both stacks to bf16, then the bf16 grouped GEMM);
- checks: every quantized path against the bf16 grouped GEMM on the dequantized stacks (rel err < 2e-2).

    python scripts/quant_moe_bench.py               # CUDA
    python scripts/quant_moe_bench.py --interpret   # CPU: tiny shapes through TRITON_INTERPRET=1, checks only

Writes $OUT/quant_moe_bench.json when OUT is set. Exits 1 on a failed check.
"""
# ruff: noqa: B023  (every timed lambda runs inside its loop iteration)
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--interpret", action="store_true")
ARGS.add_argument("--tokens", default="1024,8192")
OPTS = ARGS.parse_args()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

if OPTS.interpret:
    from lamina.kernels.interpreter import patch_triton_interpreter

    patch_triton_interpreter()

from lamina.kernels.fp8 import dequantize, quantize_blocks, quantize_rows  # noqa: E402
from lamina.kernels.moe import select_experts  # noqa: E402
from lamina.kernels.triton_fp8_moe_gemm import fp8_moe_grouped  # noqa: E402
from lamina.kernels.triton_moe import fused_moe_triton  # noqa: E402
from lamina.kernels.triton_wq_moe import wq_moe_grouped  # noqa: E402
from lamina.kernels.wq_matmul import dequantize as wq_dequantize  # noqa: E402

BENCH = not OPTS.interpret
DEV = torch.device("cuda" if BENCH else "cpu")
DTYPE = torch.bfloat16 if BENCH else torch.float16
# name: (E, top_k, H, I)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3-next-80b-a3b": (512, 10, 2048, 512)}
TOKENS = [int(t) for t in OPTS.tokens.split(",")]
if OPTS.interpret:
    SHAPES, TOKENS = {"tiny": (8, 2, 128, 128)}, [40]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def time_us(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3)
    return sorted(samples)[len(samples) // 2]


def fp8_stack(w: torch.Tensor, block):
    qs = [quantize_blocks(w[j], block) if block else quantize_rows(w[j]) for j in range(w.shape[0])]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def int4_stack(e: int, n: int, k: int, group: int, gen: torch.Generator):
    q = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8, device=DEV)
    s = (torch.rand(e, n, k // group, generator=gen, device=DEV) * 2 / (15 * k ** 0.5) + 1e-4).half()
    o = (-7.5 * s.float()).half()  # centred like a symmetric checkpoint's
    return q, s, o


def dump(rows: list, failed: list) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "quant_moe_bench.json").write_text(json.dumps({"rows": rows, "failed": failed},
                                                                               indent=1))


def main() -> int:
    # Drawn on the device: the 80B shape's stacks are ~3 billion numbers, most of a minute from the CPU's generator.
    gen = torch.Generator(device=DEV).manual_seed(0)
    failed, rows = [], []
    for shape, (e, k, h, i) in SHAPES.items():
        w13 = torch.randn(e, 2 * i, h, generator=gen, device=DEV) / h ** 0.5
        w2 = torch.randn(e, h, i, generator=gen, device=DEV) / i ** 0.5
        fp8 = {"fp8_block128": ((128, 128), *fp8_stack(w13, (128, 128)), *fp8_stack(w2, (128, 128))),
               "fp8_rows": (None, *fp8_stack(w13, None), *fp8_stack(w2, None))}
        del w13, w2
        int4 = (*int4_stack(e, 2 * i, h, 128, gen), None, *int4_stack(e, h, i, 128, gen), None)
        bf16 = (fp8["fp8_block128"][1].to(DTYPE), fp8["fp8_block128"][3].to(DTYPE))  # any bf16 stacks, same shape
        for t in TOKENS:
            x = torch.randn(t, h, device=DEV).to(DTYPE)
            weights, ids = select_experts(torch.randn(t, e, device=DEV), k, renormalize=True)
            weights = weights.to(DTYPE)
            row = {"shape": shape, "tokens": t, "experts": e, "top_k": k, "hidden": h, "intermediate": i}
            flops = 2 * t * k * 3 * h * i
            paths = {}
            for name, (block, q13, s13, q2, s2) in fp8.items():
                dq13, dq2 = dequantize(q13, s13, block, DTYPE), dequantize(q2, s2, block, DTYPE)
                err = rel_err(fp8_moe_grouped(x, q13, s13, q2, s2, block, weights, ids),
                              fused_moe_triton(x, dq13, dq2, weights, ids))
                row[f"{name}_rel_err"] = err
                if err > 2e-2:
                    failed.append(f"{shape} t{t} {name}: {err:.2e}")
                paths[name] = lambda q13=q13, s13=s13, q2=q2, s2=s2, block=block: fp8_moe_grouped(
                    x, q13, s13, q2, s2, block, weights, ids)
                if name == "fp8_block128":
                    paths["fp8_block128_dequant_then_bf16 (before)"] = lambda q13=q13, s13=s13, q2=q2, s2=s2: \
                        fused_moe_triton(x, dequantize(q13, s13, (128, 128), DTYPE),
                                         dequantize(q2, s2, (128, 128), DTYPE), weights, ids)
                del dq13, dq2
            d13 = torch.stack([wq_dequantize(int4[0][j], int4[1][j], int4[2][j], 4, DTYPE) for j in range(e)])
            d2 = torch.stack([wq_dequantize(int4[4][j], int4[5][j], int4[6][j], 4, DTYPE) for j in range(e)])
            err = rel_err(wq_moe_grouped(x, *int4, 4, weights, ids), fused_moe_triton(x, d13, d2, weights, ids))
            row["w4a16_g128_rel_err"] = err
            if err > 2e-2:
                failed.append(f"{shape} t{t} w4a16: {err:.2e}")
            del d13, d2
            paths["w4a16_g128"] = lambda: wq_moe_grouped(x, *int4, 4, weights, ids)
            if BENCH:
                base = time_us(lambda: fused_moe_triton(x, *bf16, weights, ids))
                row["bf16_us"], row["bf16_tflops"] = base, flops / base / 1e6
                for name, fn in paths.items():
                    us = time_us(fn)
                    row[f"{name}_us"] = us
                    row[f"{name}_speedup_vs_bf16"] = base / us
                print(json.dumps(row))
            rows.append(row)
            dump(rows, failed)  # after every row: a run cut off at its time limit keeps what it did
            torch.cuda.empty_cache() if BENCH else None
    dump(rows, failed)
    print("FAILED: " + "; ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
