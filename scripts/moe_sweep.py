#!/usr/bin/env python3
"""Fused MoE on the GPU (Qwen3-Next-80B-A3B layer shape: H 2048, I 512, 512 routed experts + the shared one
folded in as expert 512, top-10 + shared): the layout kernel alone, and a tile sweep of the two grouped
GEMMs, each checked against the default tiles' output and timed against its floor.

- decode64 / decode16: 64 or 16 tokens (704 / 176 pairs); floor = the distinct experts' weight bytes at the
  copy bandwidth measured in the same run;
- prefill: 8,192 tokens (90,112 pairs); floor = FLOPs at 790 TFLOP/s (bf16 dense peak measured here).
Timing as scripts/attention_sweep.py (20 calls in one CUDA graph, median of 5 replays).

    python scripts/moe_sweep.py --out moe.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from attention_sweep import time_graph

from lamina.bench.offline import copy_bandwidth
from lamina.kernels.triton_moe import MoeTiles, fused_moe_triton, moe_align, moe_tiles

H, I, E, K = 2048, 512, 513, 11
PEAK_FLOPS = 790e12


def routing(t: int, dev, gen) -> tuple[torch.Tensor, torch.Tensor]:
    routed = torch.stack([torch.randperm(E - 1, generator=gen, device="cpu")[:K - 1] for _ in range(t)])
    ids = torch.cat([routed, torch.full((t, 1), E - 1)], 1).to(dev)
    weights = torch.rand(t, K, generator=gen).to(dev, torch.bfloat16)
    return weights, ids


def variants(regime: str) -> list[MoeTiles]:
    if regime == "prefill":
        return [MoeTiles(bm, n1, k1, n2, k2, w, st) for bm, (n1, k1, n2, k2), w, st in itertools.product(
            (64, 128), ((64, 64, 128, 64), (128, 64, 128, 64), (64, 128, 64, 128), (128, 32, 128, 32)), (4, 8), (3, 4))]
    return [MoeTiles(16, n1, k1, n2, k2, w, st) for (n1, k1, n2, k2), w, st in itertools.product(
        ((32, 256, 32, 256), (64, 128, 64, 128), (64, 256, 64, 256), (128, 128, 128, 128), (32, 128, 64, 128),
         (64, 128, 128, 128), (128, 64, 128, 64)), (4, 8), (3, 4, 5))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s")
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * 0.02).to(dev, torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen) * 0.02).to(dev, torch.bfloat16)
    per_expert = (w13[0].numel() + w2[0].numel()) * 2
    rows = []
    for name, t in (("decode64", 64), ("decode16", 16), ("prefill", 8192)):
        x = torch.randn(t, H, generator=gen).to(dev, torch.bfloat16)
        weights, ids = routing(t, dev, gen)
        p_ = t * K
        if name == "prefill":
            floor = p_ * 3 * H * I * 2 / PEAK_FLOPS
        else:
            floor = ids.unique().numel() * per_expert / bw
        default = moe_tiles(p_, E, torch.bfloat16)
        ref = fused_moe_triton(x, w13, w2, weights, ids).float()
        scale = ref.abs().max().item()
        if p_ <= 4096:
            t_align = time_graph(lambda ids=ids, bm=default.block_m: moe_align(ids, E, bm))
            print(f"{name}: align kernel {t_align * 1e6:.1f} us ({p_} pairs)")
            rows.append({"shape": name, "variant": "align", "us": t_align * 1e6})
        found = []
        for tiles in [default] + variants("prefill" if name == "prefill" else "decode"):
            label = ("default " if tiles is default else "") + str(tuple(vars(tiles).values()))
            try:
                fn = lambda tiles=tiles, x=x, weights=weights, ids=ids: fused_moe_triton(  # noqa: E731
                    x, w13, w2, weights, ids, tiles=tiles)
                err = (fn().float() - ref).abs().max().item() / scale
                us = time_graph(fn) * 1e6
            except Exception as e:  # a tile that does not fit: skip it
                print(f"  {name} {label}: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
                continue
            found.append({"shape": name, "variant": label, "us": us, "frac_of_floor": floor * 1e6 / us,
                          "rel_err": err})
        found.sort(key=lambda r: r["us"])
        print(f"{name}: {t} tokens, floor {floor * 1e6:.1f} us")
        for r in found[:6] + [r for r in found if r["variant"].startswith("default")]:
            print(f"  {r['variant']:36s} {r['us']:8.1f} us  {100 * r['frac_of_floor']:5.1f}%  err {r['rel_err']:.1e}")
        rows += found
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
