#!/usr/bin/env python3
"""Paged decode attention on the GPU: tile sweep of lamina's split-K kernel and an experimental CUDA-core
variant, each checked against the torch reference and timed against the K/V byte floor.

Shapes (Qwen3-0.6B heads: Hq 16, Hkv 8, D 128, bf16, 16-token pages scattered over the pool):
- b256: 256 sequences with the offline workload's contexts (U[100, 1024] prompt + 256), the decode step
  that bounds `lamina bench throughput` (its K/V read is ~75% of the step);
- b64k4: 64 sequences of 4,096 tokens;  b1k32: one sequence of 32,768 tokens (split-K regime).
Timing: 20 calls captured in one CUDA graph, median of 5 replays; the floor is the K/V bytes at the copy
bandwidth measured in the same run. Prints one line per variant, best first, and writes JSON (--out).

    python scripts/attention_sweep.py --out sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
import triton.language as tl

from lamina.bench.offline import copy_bandwidth
from lamina.kernels.attention import AttentionMetadata, paged_attention_ref
from lamina.kernels.triton_attention import paged_attention_triton

PAGE, HQ, HKV, D = 16, 16, 8, 128


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_fma_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, bt_ptr, seq_lens_ptr, scale_log2, stride_qt, stride_qh,
                       stride_ot, stride_oh, stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                       stride_vh, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                       PAGE: tl.constexpr):
    """Decode rows only, no split: q.k and p.v as broadcast products on the CUDA cores (no MMA padding of
    the G query heads to 16 rows, no shared-memory staging of K and V)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    qh = kvh * G + g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + qh[:, None] * stride_qh + d[None, :],
                mask=(g < G)[:, None], other=0.0).to(tl.float32) * scale_log2
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for k0 in range(0, seq_len, BLOCK_N):
        kpos = k0 + n
        kmask = kpos < seq_len
        blk = tl.load(bt_row + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
        slot = (kpos % PAGE).to(tl.int64)
        k = tl.load(kc_ptr + (blk * stride_kb + slot * stride_kt + kvh * stride_kh)[:, None] + d[None, :],
                    mask=kmask[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BLOCK_N]
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + (blk * stride_vb + slot * stride_vt + kvh * stride_vh)[:, None] + d[None, :],
                    mask=kmask[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + b.to(tl.int64) * stride_ot + qh[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=(g < G)[:, None])


def decode_fma(q, kc, vc, meta, scale, block_n, warps, stages):
    b = meta.num_seqs
    out = torch.empty_like(q)
    g = HQ // HKV
    _decode_fma_kernel[(b, HKV)](q, kc, vc, out, meta.block_tables, meta.seq_lens, scale * 1.4426950408889634,
                                 q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
                                 kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
                                 G=g, G_PAD=triton.next_power_of_2(g), BLOCK_N=block_n, D=D, PAGE=PAGE,
                                 num_warps=warps, num_stages=stages)
    return out


def problem(lens: list[int], dev: torch.device, seed: int = 0):
    rng = random.Random(seed)
    nblk = [-(-n // PAGE) for n in lens]
    total = sum(nblk) + 8
    perm = list(range(total))
    rng.shuffle(perm)  # pages scattered over the pool, as after hours of serving
    width = max(nblk)
    tables, i = [], 0
    for k in nblk:
        tables.append(perm[i:i + k] + [0] * (width - k))
        i += k
    g = torch.Generator(device=dev).manual_seed(seed)
    kc = torch.randn(total, PAGE, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn(total, PAGE, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(len(lens), HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    b = len(lens)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(b, dtype=torch.int64, device=dev),
        query_start=torch.arange(b + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        query_start_cpu=list(range(b + 1)), seq_lens_cpu=list(lens), max_query_len=1, max_seq_len=max(lens))
    kv_bytes = sum(lens) * HKV * D * 2 * 2
    return q, kc, vc, meta, kv_bytes


def time_graph(fn, calls: int = 20) -> float:
    """Seconds per call: `calls` calls captured in one graph, median of 5 replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / calls)
    return statistics.median(times)


def sweep_shape(name: str, lens: list[int], bw: float, quick: bool, dev: torch.device) -> list[dict]:
    """Every variant on one shape: checked against the reference, timed; prints the best and the default."""
    scale = D ** -0.5
    q, kc, vc, meta, kv_bytes = problem(lens, dev)
    ref = paged_attention_ref(q, kc, vc, meta, scale).float()
    floor = kv_bytes / bw
    variants = [("lamina default", lambda: paged_attention_triton(q, kc, vc, meta, scale))]
    grid = itertools.product((64, 128) if quick else (32, 64, 128, 256), (4, 8) if quick else (2, 4, 8),
                             (2, 3) if quick else (1, 2, 3, 4), (None, 2) if name == "b256" else (None,))
    for bn, w, st, sp in grid:
        tune = {"decode_block_n": bn, "decode_warps": w, "decode_stages": st}
        variants.append((f"mma n{bn} w{w} s{st} splits{sp or 'auto'}",
                         lambda tune=tune, sp=sp: paged_attention_triton(q, kc, vc, meta, scale, tune=tune,
                                                                         num_splits=sp)))
    if name != "b1k32":  # no split-K in the CUDA-core variant
        for bn, w, st in itertools.product((16, 32, 64), (4, 8), (1, 2)):
            variants.append((f"fma n{bn} w{w} s{st}",
                             lambda bn=bn, w=w, st=st: decode_fma(q, kc, vc, meta, scale, bn, w, st)))
    rows = []
    for label, fn in variants:
        try:
            err = (fn().float() - ref).abs().max().item()
            t = time_graph(fn)
        except Exception as e:  # a tile that does not fit (shared memory, registers): skip it
            print(f"  {name} {label}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        rows.append({"shape": name, "variant": label, "us": t * 1e6, "frac_of_copy_bw": floor / t,
                     "max_abs_err": err})
    rows.sort(key=lambda r: r["us"])
    print(f"{name}: {len(lens)} seqs, {sum(lens)} keys, K/V {kv_bytes / 1e6:.0f} MB, floor {floor * 1e6:.1f} us")
    for r in rows[:8] + [r for r in rows if r["variant"] == "lamina default"]:
        print(f"  {r['variant']:34s} {r['us']:8.1f} us  {100 * r['frac_of_copy_bw']:5.1f}%  "
              f"err {r['max_abs_err']:.1e}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="fewer variants")
    args = p.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s")
    rng = random.Random(0)
    shapes = {"b256": [rng.randrange(100, 1025) + 256 for _ in range(256)], "b64k4": [4096] * 64,
              "b1k32": [32768]}
    results: list[dict] = []
    for name, lens in shapes.items():
        results += sweep_shape(name, lens, bw, args.quick, dev)
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bw": bw, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
