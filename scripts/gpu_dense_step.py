#!/usr/bin/env python3
"""The whole Qwen3-8B-shaped batch-1 decode step (random bf16 weights, engine CUDA graphs) under each decode
variant, in one call: us/step and % of the copy-bandwidth floor (weight bytes / measured copy bandwidth).

Variants (env switches; each builds a fresh engine since graphs fix the kernels at capture):
  cublas      LAMINA_TRITON_GEMV=0
  cublas+prep  cuBLAS with the attention prep folded into decode attention (LAMINA_FUSED_ATTN_PREP=1)
  gemv        Triton GEMV, no dense fusions            (LAMINA_FUSED_DENSE_DECODE=0)
  gemv+pro    the old prologues                        (=1)
  gemv+epi    o_proj add+norm and gate|up act epilogues (=epi)
  gemv+epi+prep  + the attention prep folded into decode attention (LAMINA_FUSED_ATTN_PREP=1)
  gemv+epi+pin+prep  + the input norm as qkv prologue  (=pro_in,epi_post,epi_act)
Correctness is checked before (the stage runs the kernel tests natively); here the greedy tokens of every
variant are compared with cuBLAS's (random weights: bf16 rounding may flip a near-tie, so it is reported).

    python scripts/gpu_dense_step.py [--steps 48] [--only gemv+epi,cublas]   # ~2 min on an H200
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

VARIANTS = {
    "cublas": {"LAMINA_TRITON_GEMV": "0", "LAMINA_FUSED_DENSE_DECODE": "0", "LAMINA_FUSED_ATTN_PREP": "0"},
    "cublas+prep": {"LAMINA_TRITON_GEMV": "0", "LAMINA_FUSED_DENSE_DECODE": "0", "LAMINA_FUSED_ATTN_PREP": "1"},
    "gemv": {"LAMINA_TRITON_GEMV": "1", "LAMINA_FUSED_DENSE_DECODE": "0", "LAMINA_FUSED_ATTN_PREP": "0"},
    "gemv+pro": {"LAMINA_TRITON_GEMV": "1", "LAMINA_FUSED_DENSE_DECODE": "1", "LAMINA_FUSED_ATTN_PREP": "0"},
    "gemv+epi": {"LAMINA_TRITON_GEMV": "1", "LAMINA_FUSED_DENSE_DECODE": "epi", "LAMINA_FUSED_ATTN_PREP": "0"},
    "gemv+epi+prep": {"LAMINA_TRITON_GEMV": "1", "LAMINA_FUSED_DENSE_DECODE": "epi", "LAMINA_FUSED_ATTN_PREP": "1"},
    "gemv+epi+pin+prep": {"LAMINA_TRITON_GEMV": "1", "LAMINA_FUSED_DENSE_DECODE": "pro_in,epi_post,epi_act",
                          "LAMINA_FUSED_ATTN_PREP": "1"},
}


def run(name: str, model: str, steps: int, prompt: list[int]) -> dict:
    from lamina import LLM, SamplingParams

    os.environ.update(VARIANTS[name])
    llm = LLM(model=model, max_num_seqs=8, progress=False, kv_cache_memory_gb=4)
    sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate([{"prompt_token_ids": prompt}], sp(8), use_tqdm=False)  # warm: tuning, compiles
    times = {}
    for n in (4, 4 + steps):  # the difference removes prefill and the first steps
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": prompt}], sp(n), use_tqdm=False)
        torch.cuda.synchronize()
        times[n] = time.perf_counter() - t0
    step_us = (times[4 + steps] - times[4]) / steps * 1e6
    # a decode step reads every weight once, the embedding table but one row (lm_head is its own unless tied)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in llm.engine.model.named_parameters()
                       if "embed_tokens" not in n)
    from lamina.bench.offline import copy_bandwidth

    bw = copy_bandwidth(llm.engine.device)
    tokens = list(outs[0].outputs[0].token_ids)
    del llm
    torch.cuda.empty_cache()
    return {"variant": name, "step_us": step_us, "floor_us": weight_bytes / bw * 1e6, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--only", default=",".join(VARIANTS))
    args = ap.parse_args()
    prompt = [1000 + (j * 31) % 5000 for j in range(128)]
    rows = []
    for name in args.only.split(","):
        try:
            rows.append(run(name, args.model, args.steps, prompt))
        except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"})
        r = rows[-1]
        if "error" in r:
            print(f"{name:20s} ERROR {r['error']}", flush=True)
            continue
        base = next((x for x in rows if x.get("variant") == "cublas" and "tokens" in x), None)
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"])) if base else -1
        print(f"{name:20s} {r['step_us']:8.0f} us/step  {100 * r['floor_us'] / r['step_us']:5.1f}% of floor "
              f"({r['floor_us']:.0f} us)  tokens equal to cublas: {same}/{len(r['tokens'])}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "dense_step.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
