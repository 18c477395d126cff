#!/usr/bin/env python3
"""Checks and times the Triton MLA decode (kernels/triton_mla_decode.py) on the GPU at DeepSeek shapes.

For each case (heads, batch, context): fresh random bf16 inputs over a shuffled paged latent cache (kv_lora_rank
512 + rope 64, block size 16; blocks no sequence owns hold NaN), the kernel against the fp32 torch reference
(kernels/mla_decode.py) with the heuristic split count and with one split, then timed by CUDA-graph replay with
the effective bandwidth over the cache bytes it must read (B x context x 576 x 2 bytes) and the q/out bytes.
Also the latent store (padding slots skipped).

    python scripts/gpu_mla_check.py              # CUDA: checks + timings, a table at the end
    python scripts/gpu_mla_check.py --interpret  # CPU: tiny shapes through TRITON_INTERPRET=1, checks only

Writes $OUT/gpu_mla_check.json when OUT is set. Exits 1 on any failed check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--interpret", action="store_true")
OPTS = ARGS.parse_args()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

if OPTS.interpret:
    from lamina.kernels.interpreter import patch_triton_interpreter

    patch_triton_interpreter()

from lamina.kernels.mla_decode import mla_decode_ref, store_latent_ref  # noqa: E402
from lamina.kernels.triton_mla_decode import mla_decode_triton, num_splits, store_latent_triton  # noqa: E402

DEV = torch.device("cpu" if OPTS.interpret else "cuda")
DTYPE = torch.float16 if OPTS.interpret else torch.bfloat16  # the interpreter's bf16 dots are wrong
C, R, PAGE = (32, 16, 4) if OPTS.interpret else (512, 64, 16)
# name: (heads, batch, context)
CASES = {"v2-lite B1 L1k": (16, 1, 1024), "v2-lite B1 L32k": (16, 1, 32768), "v2-lite B32 L2k": (16, 32, 2048),
         "v2-lite B64 L4k": (16, 64, 4096), "v3 B1 L4k": (128, 1, 4096), "v3 B16 L4k": (128, 16, 4096),
         "v3 B64 L1k": (128, 64, 1024), "odd lens B7": (16, 7, 3000)}
if OPTS.interpret:
    CASES = {"tiny B2": (4, 2, 40), "tiny heads20 B3": (20, 3, 70)}
FAILED: list[str] = []


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make(heads: int, batch: int, context: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = [max(1, context - (i * 37) % max(1, context // 3)) for i in range(batch)]
    width = (context + PAGE - 1) // PAGE
    cache = torch.full((batch * width + 2, PAGE, C + R), float("nan"), dtype=DTYPE, device=DEV)
    perm = torch.randperm(batch * width + 2, generator=g)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    for i, n in enumerate(lens):
        ids = perm[i * width:(i + 1) * width]
        tables[i] = ids.int()
        used = (n + PAGE - 1) // PAGE
        cache[ids[:used].to(DEV)] = torch.randn(used, PAGE, C + R, generator=g).to(DTYPE).to(DEV)
    q_lat = torch.randn(batch, heads, C, generator=g).to(DTYPE).to(DEV)
    q_pe = torch.randn(batch, heads, R, generator=g).to(DTYPE).to(DEV)
    return q_lat, q_pe, cache, tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV), lens


def graph_us(fn, reps: int = 20, replays: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
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


def check_decode(name: str, heads: int, batch: int, context: int) -> dict:
    q_lat, q_pe, cache, tables, seq_lens, lens = make(heads, batch, context, seed=len(name))
    scale = 192 ** -0.5
    ref = mla_decode_ref(q_lat.float().cpu(), q_pe.float().cpu(), cache.float().cpu(), tables.cpu(),
                         seq_lens.cpu(), scale)
    row = {"case": name, "heads": heads, "batch": batch, "context": context,
           "splits": num_splits(batch, (heads + 15) // 16, context)}
    for label, splits in (("auto", None), ("one", 1)):
        out = mla_decode_triton(q_lat, q_pe, cache, tables, seq_lens, scale, context, splits=splits)
        err = rel_err(out, ref)
        row[f"err_{label}"] = err
        if not err <= 1e-2:
            FAILED.append(f"{name} splits={label}: rel err {err:.2e}")
    if DEV.type == "cuda":
        us = graph_us(lambda: mla_decode_triton(q_lat, q_pe, cache, tables, seq_lens, scale, context))
        nbytes = sum(lens) * (C + R) * 2 + 2 * batch * heads * (C + R) * 2
        row.update(us=us, gbps=nbytes / us / 1e3)
    return row


def check_store() -> None:
    g = torch.Generator().manual_seed(1)
    t, blocks = 37, 16
    latent, k_pe = torch.randn(t, C, generator=g), torch.randn(t, R, generator=g)
    slots = torch.randperm(blocks * PAGE, generator=g)[:t]
    slots[::5] = -1
    ref = torch.full((blocks, PAGE, C + R), float("nan"))
    store_latent_ref(latent.to(DTYPE).float(), k_pe.to(DTYPE).float(), ref, slots)
    out = torch.full((blocks, PAGE, C + R), float("nan"), dtype=DTYPE, device=DEV)
    store_latent_triton(latent.to(DTYPE).to(DEV), k_pe.to(DTYPE).to(DEV), out, slots.to(DEV))
    same = torch.equal(out.float().cpu().nan_to_num(7.0), ref.nan_to_num(7.0))
    if not same:
        FAILED.append("store_latent differs from the reference (or wrote a padding slot)")


def main() -> int:
    check_store()
    rows = [check_decode(name, *case) for name, case in CASES.items()]
    for r in rows:
        timing = f"  {r['us']:8.1f} us  {r['gbps']:7.1f} GB/s" if "us" in r else ""
        print(f"{r['case']:18s} H{r['heads']:<4d} B{r['batch']:<3d} L{r['context']:<6d} splits {r['splits']:<3d} "
              f"err {r['err_auto']:.1e}/{r['err_one']:.1e}{timing}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_mla_check.json").write_text(json.dumps({"rows": rows, "failed": FAILED}, indent=1))
    for f in FAILED:
        print("FAILED:", f)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
