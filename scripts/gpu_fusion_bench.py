#!/usr/bin/env python3
"""Checks, then times, the decode fusions of issue 13 against the unfused launches they replace (H200, bf16):

1. MoE decode at the Qwen3-Next shape (H 2048, I 512, 512 experts + the folded shared one, top 10), T = 1, 4,
   16: routing in one launch (triton_moe_decode.route_triton) vs router F.linear + top-k kernel; the down
   projection with the weighted sum folded in (down_sum_triton, a few tiles) vs per-pair GEMV + torch sum;
   the whole block (three launches) vs the unfused path (router GEMV, top-k, fused_moe_triton). Eight inputs
   with different routings rotate through the graph so expert weights come mostly from HBM.
2. Gated RMSNorm fused into the GDN out_proj GEMV (Hv 32 x dv 128 -> 2048), T = 1, 4, 16, a few tiles, vs
   rms_norm_gated_triton + F.linear; weight copies rotated past the L2. Then the GDN conv update fused into
   the recurrent decode step (Hk 16, Hv 32, dk = dv = 128, kernel 4) vs the conv kernel + the recurrent kernel.
3. A chain of decode GEMVs over 8 layers of the Qwen3-8B shapes (qkv, o, gate_up, down) at M = 1: cuBLAS vs
   the Triton GEMV with the dispatcher's tuned configs, without and with programmatic dependent launch (L2
   prefetch of the first 0 / 512 / 2048 weight columns before griddepcontrol.wait).

Every kernel is checked on fresh random inputs before it is timed; a failed check skips its timings. Prints
a table and writes $OUT/gpu_fusion_bench.json. Exits 1 on a failed check.

    python scripts/gpu_fusion_bench.py [--quick]
"""
# ruff: noqa: B023 - every timed lambda runs inside graph_us, before its loop variables move on
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
INTERPRET = "--interpret" in sys.argv  # CPU smoke run of this script's logic: tiny shapes, no timings
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
import triton
import triton.testing

from lamina.kernels.gdn_conv_decode import gdn_conv_decode_ref
from lamina.kernels.gemv import GemvDispatcher
from lamina.kernels.moe_decode import down_sum_ref, gate_up_pairs_ref, route_ref
from lamina.kernels.norm_gated import rms_norm_gated_ref
from lamina.kernels.triton_conv1d import causal_conv1d_varlen_triton
from lamina.kernels.triton_gdn_conv_decode import gdn_conv_decode_triton, new_conv_counters
from lamina.kernels.triton_gdn_decode import gated_delta_decode_triton
from lamina.kernels.triton_gemv import gemv, heuristic_config, new_workspace
from lamina.kernels.triton_moe import _gemv2_kernel, fused_moe_triton, select_experts_triton
from lamina.kernels.triton_moe_decode import (
    down_sum_triton,
    gate_up_pairs_triton,
    moe_decode_triton,
    new_route_counter,
    route_triton,
)
from lamina.kernels.triton_norm import rms_norm_gated_triton
from lamina.kernels.triton_norm_gated_gemv import gated_norm_gemv

if INTERPRET:
    from lamina.kernels.interpreter import patch_triton_interpreter

    patch_triton_interpreter()
DEV = torch.device("cpu" if INTERPRET else "cuda")
BF = torch.bfloat16
RESULT: dict = {"moe": [], "gated_norm": [], "gdn_conv": [], "gemv_chain": [], "failed": []}


def graph_us(fn, reps: int, replays: int = 10) -> float:
    """Median us per call of fn(i), i = 0..reps-1, captured back to back in one CUDA graph."""
    if INTERPRET:
        fn(0)
        return 1.0
    for i in range(min(reps, 2)):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
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


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float("inf") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def fail(what: str) -> None:
    RESULT["failed"].append(what)
    print(f"FAIL {what}", flush=True)


# ---------------------------------------------------------------- MoE decode

H, I, E, K = (64, 32, 24, 4) if INTERPRET else (2048, 512, 512, 10)


def unfused_down(inter, w2, weights, ids):
    """What _fused_moe_gemv runs for the down projection: per-pair GEMV rows scaled, then a torch sum."""
    t, s = ids.shape
    p = t * s
    out_pairs = torch.empty(p, H, dtype=inter.dtype, device=DEV)
    bk2 = triton.next_power_of_2(I)
    bn2 = max(1, min(32, 8192 // bk2))
    _gemv2_kernel[(p, triton.cdiv(H, bn2))](inter, w2, out_pairs, ids.reshape(-1), weights.reshape(-1), H, I,
                                            inter.stride(0), w2.stride(0), w2.stride(1), out_pairs.stride(0),
                                            BLOCK_N=bn2, BLOCK_K=bk2, num_warps=4)
    return out_pairs.view(t, s, H).sum(dim=1)


def bench_moe(ts, quick: bool) -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    gw = (torch.randn(E + 1, H, generator=gen, device=DEV) / H ** 0.5).to(BF)
    w13 = (torch.randn(E + 1, 2 * I, H, generator=gen, device=DEV) / H ** 0.5).to(BF)
    w2 = (torch.randn(E + 1, H, I, generator=gen, device=DEV) / I ** 0.5).to(BF)
    counter = new_route_counter(DEV)
    for t in ts:
        xs = [torch.randn(t, H, generator=gen, device=DEV).to(BF) for _ in range(8)]
        x = xs[0]
        # checks: routing against the reference (ids per token, weights), the block against an fp32 oracle
        w, ids = route_triton(x, gw, K, True, True, counter)
        rw, rids = route_ref(x, gw, K, True, True)
        same = [sorted(a) == sorted(b) for a, b in zip(ids.tolist(), rids.tolist())]
        inter = gate_up_pairs_triton(x, w13, ids)
        e_inter = rel(inter, gate_up_pairs_ref(x, w13, ids))
        out = moe_decode_triton(x, gw, w13, w2, K, True, True, counter)
        oracle = down_sum_ref(gate_up_pairs_ref(x, w13, ids), w2, w, ids)
        e_out = rel(out, oracle)
        e_down = rel(down_sum_triton(inter, w2, w, ids), down_sum_ref(inter, w2, w, ids))
        unf = fused_moe_triton(x, w13, w2, *select_experts_triton(F.linear(x, gw), K, True, True))
        row = {"T": t, "route_same_frac": sum(same) / len(same), "err_inter": e_inter, "err_down": e_down,
               "err_block": e_out, "err_unfused_vs_fused": rel(out, unf), "counter_zero": int(counter.item()) == 0}
        ok = row["route_same_frac"] >= 0.5 and max(e_inter, e_down, e_out) < 1e-2 and row["counter_zero"]
        row["ok"] = ok
        if not ok:
            fail(f"moe T{t}: {row}")
            RESULT["moe"].append(row)
            continue
        distinct = len(set(ids.flatten().tolist()))
        b_route = (E + 1) * H * 2 + t * H * 2
        b_gu, b_down = distinct * 2 * I * H * 2, distinct * H * I * 2
        ws = [route_triton(xi, gw, K, True, True, counter) for xi in xs]
        inters = [gate_up_pairs_triton(xi, w13, wi[1]) for xi, wi in zip(xs, ws)]
        n = len(xs)
        row["route_fused_us"] = graph_us(lambda i: route_triton(xs[i % n], gw, K, True, True, counter), 16)
        row["route_unfused_us"] = graph_us(
            lambda i: select_experts_triton(F.linear(xs[i % n], gw), K, True, True), 16)
        row["gate_up_us"] = graph_us(lambda i: gate_up_pairs_triton(xs[i % n], w13, ws[i % n][1]), 16)
        tiles = [(4, None, 4)] if quick else [(4, None, 4), (2, 256, 4), (8, 128, 4), (4, 256, 8), (2, 512, 8),
                                               (1, 512, 4)]
        row["down_tiles"] = {}
        for bn, bk, warps in tiles:
            key = f"n{bn} k{bk or 'auto'} w{warps}"
            got = down_sum_triton(inters[0], w2, *ws[0], block_n=bn, block_k=bk, warps=warps)
            if rel(got, down_sum_ref(inters[0], w2, *ws[0])) > 1e-2:
                fail(f"moe down tile {key} T{t}")
                continue
            row["down_tiles"][key] = graph_us(lambda i, bn=bn, bk=bk, warps=warps: down_sum_triton(
                inters[i % n], w2, *ws[i % n], block_n=bn, block_k=bk, warps=warps), 16)
        row["down_fused_us"] = row["down_tiles"].get("n4 kauto w4", float("nan"))
        row["down_unfused_us"] = graph_us(lambda i: unfused_down(inters[i % n], w2, *ws[i % n]), 16)
        row["block_fused_us"] = graph_us(lambda i: moe_decode_triton(xs[i % n], gw, w13, w2, K, True, True, counter),
                                         16)
        row["block_unfused_us"] = graph_us(lambda i: fused_moe_triton(
            xs[i % n], w13, w2, *select_experts_triton(F.linear(xs[i % n], gw), K, True, True)), 16)
        row.update(bytes_route=b_route, bytes_gate_up=b_gu, bytes_down=b_down, distinct_experts=distinct)
        row["block_fused_gbs"] = (b_route + b_gu + b_down) / row["block_fused_us"] / 1e3
        row["down_fused_gbs"] = b_down / row["down_fused_us"] / 1e3
        RESULT["moe"].append(row)
        print(f"moe T{t:2d} route {row['route_fused_us']:.1f} vs {row['route_unfused_us']:.1f} us | down+sum "
              f"{row['down_fused_us']:.1f} vs {row['down_unfused_us']:.1f} us (tiles {row['down_tiles']}) | "
              f"gate_up {row['gate_up_us']:.1f} us | block {row['block_fused_us']:.1f} vs "
              f"{row['block_unfused_us']:.1f} us ({row['block_fused_gbs']:.0f} GB/s)", flush=True)


# ---------------------------------------------------------------- gated norm + out_proj

HV, DV, N_OUT = (4, 32, 48) if INTERPRET else (32, 128, 2048)


def bench_gated_norm(ts, l2: int, quick: bool) -> None:
    gen = torch.Generator(device=DEV).manual_seed(1)
    copies = max(1, math.ceil(3 * l2 / (N_OUT * HV * DV * 2)))
    ws = [(torch.randn(N_OUT, HV * DV, generator=gen, device=DEV) / 64).to(BF) for _ in range(copies)]
    nw = (torch.rand(DV, generator=gen, device=DEV) + 0.5).to(BF)
    for t in ts:
        proj = torch.randn(t, 3 * HV * DV, generator=gen, device=DEV).to(BF)
        z = proj[:, HV * DV:2 * HV * DV].view(t, HV, DV)
        x = torch.randn(t, HV, DV, generator=gen, device=DEV).to(BF)
        # the norm rounded to bf16 where the layer rounds it, the matmul in fp32
        ref = rms_norm_gated_ref(x, z, nw, 1e-6).view(t, -1).float() @ ws[0].float().T
        tiles = [None] if quick else [None, dict(block_n=4, heads=4, dot=False), dict(block_n=8, heads=8, dot=False),
                                      dict(block_n=16, heads=2, dot=True), dict(block_n=16, heads=4, dot=True),
                                      dict(block_n=8, heads=4, dot=False, warps=8)]
        row = {"T": t, "tiles": {}}
        for kw in tiles:
            if kw is not None and ((not kw["dot"] and t > 4) or (kw["dot"] and INTERPRET)):
                continue  # fma tiles are for <= 4 rows; the interpreter's bf16 dots are wrong
            key = "default" if kw is None else " ".join(f"{k}={v}" for k, v in kw.items())
            err = rel(gated_norm_gemv(x, z, nw, 1e-6, ws[0], **(kw or {})), ref)
            if err > (2e-2 if INTERPRET else 1e-2):  # the interpreter truncates bf16 casts
                fail(f"gated_norm_gemv T{t} {key} err {err:.2e}")
                continue
            row["tiles"][key] = {"err": err, "us": graph_us(
                lambda i, kw=kw: gated_norm_gemv(x, z, nw, 1e-6, ws[i % copies], **(kw or {})), 4 * copies)}
        row["unfused_us"] = graph_us(lambda i: F.linear(rms_norm_gated_triton(x, z, nw, 1e-6).view(t, -1),
                                                        ws[i % copies]), 4 * copies)
        row["bytes"] = N_OUT * HV * DV * 2 + 2 * t * HV * DV * 2 + t * N_OUT * 2
        if row["tiles"]:
            best = min(row["tiles"].items(), key=lambda kv: kv[1]["us"])
            row.update(best=best[0], best_us=best[1]["us"], best_gbs=row["bytes"] / best[1]["us"] / 1e3)
            print(f"gated_norm+out_proj T{t:2d}: fused best {row['best']} {row['best_us']:.1f} us "
                  f"({row['best_gbs']:.0f} GB/s) vs norm + cuBLAS {row['unfused_us']:.1f} us; tiles "
                  f"{ {k: round(v['us'], 1) for k, v in row['tiles'].items()} }", flush=True)
        RESULT["gated_norm"].append(row)


# ---------------------------------------------------------------- GDN conv + recurrent decode step

GHK, GDK, GHV, GDV, GKW = (2, 16, 4, 32, 4) if INTERPRET else (16, 128, 32, 128, 4)


def bench_gdn_conv(ts) -> None:
    gen = torch.Generator(device=DEV).manual_seed(3)
    c = 2 * GHK * GDK + GHV * GDV
    w = (torch.randn(c, GKW, generator=gen, device=DEV) / 2).to(BF)
    a_log = torch.rand(GHV, generator=gen, device=DEV)
    dtb = torch.randn(GHV, generator=gen, device=DEV) * 0.5
    for t in ts:
        n_slots = t + 4
        conv0 = torch.randn(n_slots, c, GKW - 1, generator=gen, device=DEV).to(BF)
        ssm0 = torch.randn(n_slots, GHV, GDK, GDV, generator=gen, device=DEV) * 0.1
        slots = torch.randperm(n_slots, generator=gen, device=DEV)[:t]
        init = torch.ones(t, dtype=torch.bool, device=DEV)
        proj = torch.randn(t, c + 2 * GHV, generator=gen, device=DEV).to(BF)
        x, a, b = proj[:, :c], proj[:, c:c + GHV], proj[:, c + GHV:]
        counters = new_conv_counters(t, GHK, DEV)
        conv_f, ssm_f, conv_r, ssm_r = conv0.clone(), ssm0.clone(), conv0.clone(), ssm0.clone()
        got = gdn_conv_decode_triton(x, w, None, conv_f, a, b, a_log, dtb, ssm_f, slots, init, counters, GHK, GDK,
                                     GHV, GDV)
        want = gdn_conv_decode_ref(x, w, None, conv_r, a, b, a_log, dtb, ssm_r, slots.tolist(), [True] * t, GHK, GDK,
                                   GHV, GDV)
        used = slots.tolist()
        row = {"T": t, "err_out": rel(got, want), "err_conv": rel(conv_f[used], conv_r[used]),
               "err_ssm": rel(ssm_f[used], ssm_r[used]), "counters_zero": int(counters.abs().sum()) == 0}
        row["ok"] = max(row["err_out"], row["err_conv"], row["err_ssm"]) < 2e-2 and row["counters_zero"]
        if not row["ok"]:
            fail(f"gdn conv decode T{t}: {row}")
            RESULT["gdn_conv"].append(row)
            continue
        qs = torch.arange(t + 1, dtype=torch.int32, device=DEV)
        key_dim = GHK * GDK

        def unfused(i):
            y = causal_conv1d_varlen_triton(x, w, None, conv_f, qs, slots, init, 1, "silu")
            q, k, v = y.split([key_dim, key_dim, GHV * GDV], dim=-1)
            return gated_delta_decode_triton(q.view(t, GHK, GDK), k.view(t, GHK, GDK), v.view(t, GHV, GDV), a, b,
                                             a_log, dtb, ssm_f, slots, init)

        row["fused_us"] = graph_us(lambda i: gdn_conv_decode_triton(x, w, None, conv_f, a, b, a_log, dtb, ssm_f, slots,
                                                                    init, counters, GHK, GDK, GHV, GDV), 16)
        row["unfused_us"] = graph_us(unfused, 16)
        row["bytes"] = t * (2 * GHV * GDK * GDV * 4 + 2 * c * (GKW - 1) * 2 + c * 2 + GHV * GDV * 2)
        row["fused_gbs"] = row["bytes"] / row["fused_us"] / 1e3
        RESULT["gdn_conv"].append(row)
        print(f"gdn conv+recurrent T{t:2d}: fused {row['fused_us']:.1f} us ({row['fused_gbs']:.0f} GB/s) vs conv + "
              f"recurrent {row['unfused_us']:.1f} us", flush=True)


# ---------------------------------------------------------------- GEMV chain with and without PDL

SHAPES_8B = [(48, 64), (64, 64), (96, 64), (64, 128)] if INTERPRET else \
    [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def bench_gemv_chain(layers: int, copy_gbs: float) -> None:
    gen = torch.Generator(device=DEV).manual_seed(2)
    weights = [[(torch.randn(n, k, generator=gen, device=DEV) / k ** 0.5).to(BF) for n, k in SHAPES_8B]
               for _ in range(layers)]
    xs = {k: torch.randn(1, k, generator=gen, device=DEV).to(BF) for k in {k for _, k in SHAPES_8B}}
    outs = {(n, k): torch.empty(1, n, dtype=BF, device=DEV) for n, k in SHAPES_8B}
    disp = GemvDispatcher(enabled=True, tune=not INTERPRET)
    tuned = {}
    sms = 132 if INTERPRET else torch.cuda.get_device_properties(DEV).multi_processor_count
    for (n, k), w in zip(SHAPES_8B, weights[0]):
        disp(xs[k], w)
        picked = [c for key, c in disp.configs.items() if key[1] == n and key[2] == k]
        tuned[(n, k)] = picked[0] if picked else heuristic_config(1, n, k, sms)
    nbytes = sum(n * k * 2 for n, k in SHAPES_8B) * layers

    def chain(cfgs):
        wss = {s: new_workspace(1, s[0], c, DEV) if c.split_k > 1 else None for s, c in cfgs.items()}

        def run(i):
            for layer in weights:
                for (n, k), w in zip(SHAPES_8B, layer):
                    gemv(xs[k], w, None, cfgs[(n, k)], wss[(n, k)], out=outs[(n, k)])
        return run

    variants = {"cublas": lambda i: [torch.mm(xs[k], w.t(), out=outs[(n, k)]) for layer in weights
                                     for (n, k), w in zip(SHAPES_8B, layer)],
                "triton tuned": chain(tuned)}
    for pf in () if INTERPRET else (0, 512, 2048):
        variants[f"triton tuned + pdl prefetch {pf}"] = chain(
            {s: dataclasses.replace(c, pdl=True, prefetch_k=pf) for s, c in tuned.items()})
    for name, fn in variants.items():
        try:
            fn(0)
            if not INTERPRET:
                torch.cuda.synchronize()
            for (n, k), w in zip(SHAPES_8B, weights[-1]):  # the last layer's outputs are what the chain left
                if rel(outs[(n, k)], F.linear(xs[k].float(), w.float())) > 1e-2:
                    raise AssertionError(f"wrong output for {n}x{k}")
            us = graph_us(fn, 2)
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the rest still run
            fail(f"gemv chain {name}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        row = {"variant": name, "layers": layers, "us_per_layer": us / layers, "bytes_per_layer": nbytes / layers,
               "gbs": nbytes / us / 1e3, "frac_copy": nbytes / us / 1e3 / copy_gbs,
               "configs": {f"{n}x{k}": c.label() for (n, k), c in tuned.items()} if "triton" in name else None}
        RESULT["gemv_chain"].append(row)
        print(f"gemv chain {name:34s} {row['us_per_layer']:7.1f} us/layer {row['gbs']:6.0f} GB/s "
              f"({100 * row['frac_copy']:.1f}% of copy)", flush=True)


def measure_copy_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * (1 << 30) / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="default tiles only")
    ap.add_argument("--chain-layers", type=int, default=8)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (tiny shapes, no timings)")
    args = ap.parse_args()
    start = time.perf_counter()
    copy_gbs = 1.0 if INTERPRET else measure_copy_gbs()
    l2 = 1 << 20 if INTERPRET else torch.cuda.get_device_properties(DEV).L2_cache_size
    RESULT.update(device="interpreter" if INTERPRET else torch.cuda.get_device_name(DEV), copy_GBs=copy_gbs)
    print(f"device {RESULT['device']}, copy {copy_gbs:.0f} GB/s, L2 {l2 >> 20} MiB", flush=True)
    ts = (1, 3) if INTERPRET else (1, 4, 16)
    for name, fn in (("moe", lambda: bench_moe(ts, args.quick)),
                     ("gated_norm", lambda: bench_gated_norm(ts, l2, args.quick)),
                     ("gdn_conv", lambda: bench_gdn_conv(ts)),
                     ("gemv_chain", lambda: bench_gemv_chain(2 if INTERPRET else args.chain_layers, copy_gbs))):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one section failing must not hide the others
            fail(f"section {name}: {type(exc).__name__}: {str(exc)[:300]}")
        torch.cuda.empty_cache()
    RESULT["wall_s"] = time.perf_counter() - start
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_fusion_bench.json").write_text(json.dumps(RESULT, indent=1, default=str))
    print(f"{RESULT['wall_s']:.0f} s; " + ("FAILED:\n  " + "\n  ".join(RESULT["failed"]) if RESULT["failed"]
                                           else "all checks passed"))
    return 1 if RESULT["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
