#!/usr/bin/env python3
"""Paged decode attention on the GPU: the first kernel (LAMINA_DECODE_ATTN=old) against the packed one and
against torch SDPA's flash backend on the dense (unpaged) equivalent, checked against the torch reference
first. One call, a few minutes:

    python scripts/gpu_attention_bench.py                 # checks, then the five decode shapes + prefill
    python scripts/gpu_attention_bench.py --sweep         # checks, then a config sweep per decode shape
    python scripts/gpu_attention_bench.py --interpret     # CPU smoke run (tiny shapes, Triton interpreter)

Shapes: Qwen3-0.6B heads (Hq 16, Hkv 8, D 128), bf16, 16-token pages scattered over the pool; (B, ctx) in
(256, 800), (64, 2048), (1, 8192), (1, 32768), (32, 4096), plus "256xU356-1280" (256 x U[356, 1280]: the
offline bench's decode step, the shape of scripts/attention_sweep.py). Timing: `calls` launches captured in
one CUDA graph, median of replays, cycling over enough copies of the problem that the working set is 3x the
L2 (a 33 MB 1 x 8k cache would otherwise be read from L2). Bytes: K/V actually read (the context's keys,
every KV head) + q + out; the split-K partials are reported apart. Writes summary.txt and
attention_bench.json (--sweep: sweep_summary.txt, attention_sweep.json) under $OUT (or --out).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ARGS.add_argument("--interpret", action="store_true", help="CPU run through Triton's interpreter, tiny shapes")
ARGS.add_argument("--sweep", action="store_true", help="sweep decode configs and print the best per shape")
ARGS.add_argument("--quick", action="store_true", help="fewer sweep configs")
ARGS.add_argument("--no-prefill", action="store_true")
ARGS.add_argument("--shapes", default="", help="comma-separated shape names to run (default: all)")
ARGS.add_argument("--out", default=os.environ.get("OUT", "."))
OPTS = ARGS.parse_args()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if OPTS.interpret:
    from lamina.kernels.interpreter import patch_triton_interpreter

    patch_triton_interpreter()

from lamina.kernels import triton_decode_attention as tda  # noqa: E402
from lamina.kernels.attention import AttentionMetadata, paged_attention_ref  # noqa: E402
from lamina.kernels.triton_attention import decode_num_splits, paged_attention_triton  # noqa: E402

CUDA = not OPTS.interpret
DEV = torch.device("cuda" if CUDA else "cpu")
DT = torch.bfloat16 if CUDA else torch.float16  # the interpreter's bf16 dots are wrong
HQ, HKV, D, PAGE = 16, 8, 128, 16
PEAK = 4.2e12  # H200 copy bandwidth the issue measures against
TOL = 1e-2 if DT == torch.bfloat16 else 3e-3
SHAPES = [("256x800", [800] * 256), ("64x2048", [2048] * 64), ("1x8192", [8192]), ("1x32768", [32768]),
          ("32x4096", [4096] * 32), ("256xU356-1280", [random.Random(0).randrange(356, 1281) for _ in range(256)])]
if not CUDA:
    SHAPES = [("2x40", [40] * 2), ("1x100", [100]), ("3xU1-70", [1, 33, 70])]
if OPTS.shapes:
    SHAPES = [(n, lens) for n, lens in SHAPES if n in OPTS.shapes.split(",")]
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def paged_problem(lens: list[int], seed: int):
    """q, caches and decode metadata; pages shuffled over the pool as after hours of serving."""
    rng = random.Random(seed)
    nblk = [-(-n // PAGE) for n in lens]
    total = sum(nblk) + 1
    perm = list(range(total))
    rng.shuffle(perm)
    width, tables, i = max(nblk), [], 0
    for k in nblk:
        tables.append(perm[i:i + k] + [0] * (width - k))
        i += k
    g = torch.Generator(device=DEV).manual_seed(seed)
    kc, vc = (torch.randn(total, PAGE, HKV, D, device=DEV, generator=g).to(DT) for _ in range(2))
    b = len(lens)
    q = torch.randn(b, HQ, D, device=DEV, generator=g).to(DT)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(b, dtype=torch.int64, device=DEV),
        query_start=torch.arange(b + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=DEV),
        query_start_cpu=list(range(b + 1)), seq_lens_cpu=list(lens), max_query_len=1, max_seq_len=max(lens))
    return q, kc, vc, meta


def dense_of(q, kc, vc, meta):
    """The same problem unpaged for SDPA (equal lengths only): the G query heads of a KV head become G query
    positions, so no GQA support is needed and the flash kernel reads each K/V row once."""
    b, n = meta.num_seqs, meta.seq_lens_cpu[0]
    blocks = meta.block_tables[:, : -(-n // PAGE)].long()
    k = kc[blocks].flatten(1, 2)[:, :n].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, n, D]
    v = vc[blocks].flatten(1, 2)[:, :n].permute(0, 2, 1, 3).contiguous()
    return q.view(b, HKV, HQ // HKV, D).contiguous(), k, v


def sdpa_flash(qd, k, v):
    if not CUDA:
        return F.scaled_dot_product_attention(qd, k, v)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(qd, k, v)


def time_us(fns, calls: int = 40, reps: int = 7) -> float:
    """Microseconds per call: `calls` calls cycling over fns (one per problem copy) in one CUDA graph, median
    of `reps` replays. On the CPU: one call, wall clock (a smoke test, not a measurement)."""
    if not CUDA:
        t0 = time.perf_counter()
        fns[0]()
        return (time.perf_counter() - t0) * 1e6
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device copy, read + write counted (CUDA events)."""
    if not CUDA:
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = time_us([lambda: dst.copy_(src)], calls=10, reps=5)
    return 2 * src.numel() / (us * 1e-6)


def copies_for(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size if CUDA else 1
    return max(1, min(8, -(-3 * l2 // max(nbytes, 1))))


def kv_bytes(lens: list[int]) -> int:
    return sum(lens) * HKV * D * 2 * DT.itemsize


def io_bytes(lens: list[int]) -> int:
    return kv_bytes(lens) + 2 * len(lens) * HQ * D * DT.itemsize  # + q and out


def decode_fn(p, variant: str, tune=None, splits=None):
    q, kc, vc, meta = p
    return lambda: paged_attention_triton(q, kc, vc, meta, D ** -0.5, tune=tune, num_splits=splits,
                                          decode_variant=variant)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def check(name: str, lens: list[int]) -> tuple[list, bool]:
    """Old kernel, new kernel (table config, forced split, 2 heads per program) and SDPA vs the reference."""
    p = paged_problem(lens, seed=1)
    q, kc, vc, meta = p
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, D ** -0.5)
    outs = {"old": decode_fn(p, "old")(), "new": decode_fn(p, "new")(),
            "new split4": decode_fn(p, "new", splits=4)(),
            "new heads2": decode_fn(p, "new", tune={"decode_heads": 2})(),
            "new direct ahead": decode_fn(p, "new", tune={"decode_ids_ahead": True}, splits=1)(),
            "new split8 not-ahead": decode_fn(p, "new", tune={"decode_ids_ahead": False}, splits=8)()}
    if len(set(lens)) == 1:
        outs["sdpa"] = sdpa_flash(*dense_of(q, kc, vc, meta)).reshape(q.shape)
    errs = {k: rel_err(v, ref) for k, v in outs.items()}
    ok = all(e < TOL for e in errs.values())
    say(f"check {name:16s} {'ok  ' if ok else 'FAIL'} " + " ".join(f"{k}={e:.1e}" for k, e in errs.items()))
    return [p], ok


def bench_shape(name: str, lens: list[int], copy_bw: float) -> dict:
    n_copies = copies_for(kv_bytes(lens))
    probs = [paged_problem(lens, seed=10 + i) for i in range(n_copies)]
    b = len(lens)
    splits = decode_num_splits(b, HKV, DEV)
    row = {"shape": name, "batch": b, "mean_ctx": sum(lens) / b, "kv_bytes": kv_bytes(lens),
           "io_bytes": io_bytes(lens), "copies": n_copies, "new_splits": splits,
           "new_config": tda.decode_config(DT, D, b, HKV, tda.device_sms(DEV)).__dict__,
           "partial_bytes": 0 if splits == 1 else 2 * b * HQ * splits * (D + 2) * 4}
    row["old_us"] = time_us([decode_fn(p, "old") for p in probs])
    row["new_us"] = time_us([decode_fn(p, "new") for p in probs])
    if len(set(lens)) == 1:
        dense = [dense_of(*p) for p in probs]
        row["sdpa_flash_us"] = time_us([lambda d=d: sdpa_flash(*d) for d in dense])
        del dense
    parts = [f"{name:16s} {row['kv_bytes'] / 1e6:7.1f} MB splits {splits:2d}"]
    for k in ("old", "new", "sdpa_flash"):
        if f"{k}_us" in row:
            bw = row["io_bytes"] / (row[f"{k}_us"] * 1e-6)
            row[f"{k}_GBps"], row[f"{k}_pct_4p2"] = bw / 1e9, 100 * bw / PEAK
            row[f"{k}_pct_copy"] = 100 * bw / copy_bw
            parts.append(f"{k} {row[f'{k}_us']:7.1f} us {bw / 1e9:5.0f} GB/s {row[f'{k}_pct_4p2']:5.1f}%")
    say(" | ".join(parts))
    return row


def sweep_configs() -> list[tuple]:
    """(heads, block_n, warps, stages, ids_ahead): 64-256 key columns per step; splits are swept on top."""
    pairs = [(1, 64), (1, 128), (2, 32), (2, 64), (4, 16), (4, 32), (8, 16), (8, 32)]
    ws = [(4, 2), (4, 3), (8, 2), (8, 3)]
    if OPTS.quick:
        pairs, ws = [(1, 64), (1, 128), (2, 64), (4, 32), (8, 16)], [(4, 2), (4, 3), (8, 2)]
    if not CUDA:
        pairs, ws = [(1, 16), (2, 16), (8, 16)], [(4, 2)]
    return [(h, n, w, s, a) for (h, n), (w, s), a in itertools.product(pairs, ws, (False, True))]


def sweep_shape(name: str, lens: list[int]) -> list[dict]:
    n_copies = copies_for(kv_bytes(lens))
    probs = [paged_problem(lens, seed=20 + i) for i in range(n_copies)]
    q, kc, vc, meta = probs[0]
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, D ** -0.5)
    sms = tda.device_sms(DEV)
    regime = tda.decode_regime(len(lens), HKV, sms)
    rows = []
    for h, n, w, s, a in sweep_configs():
        auto = tda.plan_splits(len(lens), HKV, h, sms)[2]
        for sp in sorted({auto, max(1, auto // 2), min(256, auto * 2)} | ({1} if auto <= 4 else set())):
            tune = {"decode_heads": h, "decode_block_n": n, "decode_warps": w, "decode_stages": s,
                    "decode_ids_ahead": a}
            try:
                err = rel_err(decode_fn(probs[0], "new", tune, sp)(), ref)
                us = time_us([decode_fn(p, "new", tune, sp) for p in probs])
            except Exception as e:  # a tile that does not fit (shared memory, registers): skip it
                say(f"  {name} h{h} n{n} w{w} s{s} a{int(a)} splits{sp}: {type(e).__name__}: "
                    f"{str(e).splitlines()[0][:80]}")
                continue
            rows.append({"shape": name, "regime": regime, "heads": h, "block_n": n, "warps": w, "stages": s,
                         "ids_ahead": a, "splits": sp, "auto_splits": sp == auto, "us": us, "err": err,
                         "pct_4p2": 100 * io_bytes(lens) / (us * 1e-6) / PEAK})
    old_us = time_us([decode_fn(p, "old") for p in probs])
    good = sorted((r for r in rows if r["err"] < TOL), key=lambda r: r["us"])
    say(f"sweep {name} ({regime}; old kernel {old_us:.1f} us): best of {len(rows)}")
    for r in good[:5]:
        say(f"  h{r['heads']} n{r['block_n']:3d} w{r['warps']} s{r['stages']} ahead {int(r['ids_ahead'])} "
            f"splits {r['splits']:3d}"
            f"{' (auto)' if r['auto_splits'] else '       '} {r['us']:8.1f} us {r['pct_4p2']:5.1f}% err {r['err']:.1e}")
    if good:
        r = good[0]
        say(f"  table row: (\"16\", 128, \"{regime}\"): DecodeConfig({r['heads']}, {r['block_n']}, {r['warps']}, "
            f"{r['stages']}, {r['ids_ahead']}),  # {name} {r['us']:.1f} us, splits {r['splits']}"
            f"{'' if r['auto_splits'] else ' (not the auto count: revisit decode_splits)'}")
    return rows + [{"shape": name, "variant": "old", "us": old_us}]


def prefill_row(b: int, n: int) -> dict:
    """lamina's varlen prefill kernel (b fresh prompts of n tokens, causal) vs SDPA flash on the same batch."""
    g = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(b * n, HQ, D, device=DEV, generator=g).to(DT)
    lens = [n] * b
    _, kc, vc, dmeta = paged_problem(lens, seed=4)
    qs = [i * n for i in range(b + 1)]
    meta = AttentionMetadata(torch.zeros(b * n, dtype=torch.int64, device=DEV),
                             torch.tensor(qs, dtype=torch.int32, device=DEV), dmeta.seq_lens,
                             dmeta.block_tables, qs, lens, n, n)
    _, k, v = dense_of(torch.zeros(b, HQ, D, device=DEV, dtype=DT), kc, vc, dmeta)
    qd = q.view(b, n, HQ, D).transpose(1, 2).contiguous()
    kf, vf = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))  # Hq heads of K/V: no GQA needed

    def flash():
        if not CUDA:
            return F.scaled_dot_product_attention(qd, kf, vf, is_causal=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qd, kf, vf, is_causal=True)

    def lam():
        return paged_attention_triton(q, kc, vc, meta, D ** -0.5)

    err = rel_err(lam(), flash().transpose(1, 2).reshape(q.shape).float())
    flops = 4 * b * HQ * D * n * (n + 1) / 2
    row = {"shape": f"prefill {b}x{n}", "lamina_us": time_us([lam], calls=10), "err_vs_flash": err,
           "sdpa_flash_us": time_us([flash], calls=10), "flop": flops}
    say(f"prefill {b:2d}x{n:5d}: lamina {row['lamina_us']:8.1f} us ({flops / row['lamina_us'] / 1e6:5.0f} "
        f"TFLOP/s) | sdpa flash {row['sdpa_flash_us']:8.1f} us ({flops / row['sdpa_flash_us'] / 1e6:5.0f} "
        f"TFLOP/s) | err vs flash {err:.1e}")
    return row


def main() -> int:
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name() if CUDA else "cpu (interpreter)"
    bw = copy_bandwidth()
    say(f"{name}  torch {torch.__version__}  copy {bw / 1e12:.2f} TB/s (read+write)  % below: of 4.2 TB/s")
    ok = True
    for shape, lens in SHAPES:
        ok &= check(shape, [min(n, 4096) for n in lens])[1]  # the reference needs fp32 copies: cap the length
    result: dict = {"device": name, "copy_bw": bw, "checks_ok": ok}
    if OPTS.sweep:
        result["sweep"] = [r for shape, lens in SHAPES for r in sweep_shape(shape, lens)]
    else:
        result["decode"] = [bench_shape(shape, lens, bw) for shape, lens in SHAPES]
        if not OPTS.no_prefill:
            result["prefill"] = [prefill_row(b, n) for b, n in ([(1, 4096), (4, 2048), (16, 512)] if CUDA
                                                                   else [(1, 40)])]
    say(f"checks {'ok' if ok else 'FAILED'}; {time.perf_counter() - t0:.0f} s")
    out = Path(OPTS.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("attention_sweep.json" if OPTS.sweep else "attention_bench.json")).write_text(json.dumps(result, indent=1))
    (out / ("sweep_summary.txt" if OPTS.sweep else "summary.txt")).write_text("\n".join(LINES) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
