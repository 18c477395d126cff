#!/usr/bin/env python3
"""Checks every lamina Triton kernel against its torch reference on fresh random inputs, then times both.

    python scripts/gpu_kernels_check.py              # on a CUDA machine: checks + timings (bf16)
    python scripts/gpu_kernels_check.py --interpret  # on a CPU: tiny shapes through TRITON_INTERPRET=1

Errors are ||out - oracle|| / ||oracle||, the oracle being the torch reference run on fp32 copies of the
inputs. Thresholds follow /work/.library/device/METHOD.md. Outputs (and split-K workspaces) are poisoned
with NaN before each run, unused KV-cache slots and padding block-table entries hold NaN for the kernel
(the oracle sees zeros there), and every output element must come back finite. Exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--interpret", action="store_true", help="CPU run through Triton's interpreter, tiny shapes")
ARGS.add_argument("--no-bench", action="store_true")
ARGS.add_argument("--seed", type=int, default=0)
OPTS = ARGS.parse_args()
if OPTS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

if OPTS.interpret:
    from lamina.kernels.interpreter import patch_triton_interpreter

    patch_triton_interpreter()

from lamina.kernels.activation import silu_and_mul_ref  # noqa: E402
from lamina.kernels.attention import AttentionMetadata, paged_attention_ref, store_kv_ref  # noqa: E402
from lamina.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref  # noqa: E402
from lamina.kernels.rope import apply_rope_ref, rope_cos_sin_cache, rope_inv_freq  # noqa: E402
from lamina.kernels.triton_activation import silu_and_mul_triton  # noqa: E402
from lamina.kernels.triton_attention import paged_attention_triton, store_kv_triton  # noqa: E402
from lamina.kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton  # noqa: E402
from lamina.kernels.triton_rope import apply_rope_triton  # noqa: E402

DEV = torch.device("cpu" if OPTS.interpret else "cuda")
BENCH = not OPTS.interpret and not OPTS.no_bench
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
ROWS: list[dict] = []
FAILED: list[str] = []


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bench(fn) -> float:
    """Median microseconds (do_bench flushes L2 between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def bench_graph(fn) -> float:
    """Median microseconds of a CUDA-graph replay of fn: the launch cost the engine's decode graphs avoid
    is left out, so small kernels are timed on the device rather than on the Python launcher."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def record(kernel: str, case: str, dtype, err: float, ref_err: float, fn=None, ref_fn=None, nbytes=0, flops=0,
           extra_ok: bool = True) -> None:
    ok = extra_ok and err <= TOL[dtype]
    row = dict(kernel=kernel, case=case, dtype=SHORT[dtype], err=err, ref_err=ref_err, ok=ok)
    if BENCH and fn is not None and dtype == torch.bfloat16:
        row["eager_us"] = bench(fn)
        row["t_us"] = bench_graph(fn)
        row["ref_us"] = bench(ref_fn) if ref_fn is not None else float("nan")
        row["gbs"] = nbytes / row["t_us"] / 1e3 if nbytes else float("nan")
        row["tflops"] = flops / row["t_us"] / 1e6 if flops else float("nan")
    ROWS.append(row)
    print(f"{'ok  ' if ok else 'FAIL'} {kernel:10s} {case:34s} {SHORT[dtype]} err={err:.2e} ref_err={ref_err:.2e}"
          + (f" graph={row['t_us']:.1f}us eager={row['eager_us']:.1f}us ref={row['ref_us']:.1f}us"
             if "t_us" in row else ""), flush=True)
    if not ok:
        FAILED.append(f"{kernel} {case} {SHORT[dtype]}")


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


# ---------------------------------------------------------------- attention


def build_attention(specs, hq, hkv, d, page, dtype, gen):
    """specs: [(query_len, seq_len)]. Returns the pieces of one step with this step's K/V not yet stored."""
    b = len(specs)
    need = [-(-sl // page) for _, sl in specs]
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(need)
    # Padding entries point at real (foreign) blocks: reading one would be a visible error.
    tables = torch.randint(0, num_blocks, (b, width), generator=gen, dtype=torch.int32)
    used, slots_new, qs = 0, [], [0]
    kc = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype)
    vc = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype)
    for i, (ql, sl) in enumerate(specs):
        tables[i, :need[i]] = perm[used:used + need[i]].int()
        used += need[i]
        pos = torch.arange(sl)
        slot = tables[i, pos // page].long() * page + pos % page
        old = slot[: sl - ql]
        kc.view(-1, hkv, d)[old] = torch.randn(len(old), hkv, d, generator=gen).to(dtype)
        vc.view(-1, hkv, d)[old] = torch.randn(len(old), hkv, d, generator=gen).to(dtype)
        slots_new.append(slot[sl - ql:])
        qs.append(qs[-1] + ql)
    t = qs[-1]
    slot_mapping = torch.cat(slots_new)
    meta = AttentionMetadata(slot_mapping=slot_mapping.to(DEV), query_start=torch.tensor(qs, dtype=torch.int32,
                             device=DEV), seq_lens=torch.tensor([s for _, s in specs], dtype=torch.int32,
                             device=DEV), block_tables=tables.to(DEV), query_start_cpu=qs,
                             seq_lens_cpu=[s for _, s in specs], max_query_len=max(q for q, _ in specs),
                             max_seq_len=max(s for _, s in specs))
    q = torch.randn(t, hq, d, generator=gen).to(dtype).to(DEV)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype).to(DEV)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype).to(DEV)
    return q, k, v, kc.to(DEV), vc.to(DEV), meta


def check_attention(name, specs, hq, hkv, d, dtype, window=None, page=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, kc, vc, meta = build_attention(specs, hq, hkv, d, page, dtype, gen)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv_triton(k, v, kc, vc, meta.slot_mapping)
    store_kv_ref(k, v, kc_ref, vc_ref, meta.slot_mapping)
    # A store is a copy: bit-exact, and the slots it must not touch still hold their NaN.
    store_ok = all(torch.equal(a.nan_to_num(0), b.nan_to_num(0)) and torch.equal(a.isnan(), b.isnan())
                   for a, b in ((kc, kc_ref), (vc, vc_ref)))
    scale = d ** -0.5
    kcz, vcz = kc_ref.float().nan_to_num(0.0), vc_ref.float().nan_to_num(0.0)
    oracle = paged_attention_ref(q.float(), kcz, vcz, meta, scale, window)
    ref_lo = paged_attention_ref(q, kc_ref.nan_to_num(0.0), vc_ref.nan_to_num(0.0), meta, scale, window)
    out = paged_attention_triton(q, kc, vc, meta, scale, window, out=nan_like(q), poison_workspace=True)
    out2 = paged_attention_triton(q, kc, vc, meta, scale, window, out=nan_like(q), poison_workspace=True)
    stable = bool(torch.equal(out, out2))  # a moving result would mean a race
    err = rel_err(out, oracle)
    if 1 in [ql for ql, _ in specs]:  # the other decode path: one split written directly, or split-K
        splits = 4 if meta.num_seqs * hkv >= 264 else 1
        out1 = paged_attention_triton(q, kc, vc, meta, scale, window, out=nan_like(q), num_splits=splits,
                                      poison_workspace=True)
        err = max(err, rel_err(out1, oracle))
    kv_bytes = sum(min(s, window or s) for _, s in specs) * hkv * 2 * d * q.element_size()
    flops = sum(4 * hq * d * sum(min(sl - ql + i + 1, window or 1 << 62) for i in range(ql)) for ql, sl in specs) \
        if max(ql for ql, _ in specs) > 1 else 0
    kcz_lo, vcz_lo = kc_ref.nan_to_num(0.0), vc_ref.nan_to_num(0.0)
    record("attention", name, dtype, err, rel_err(ref_lo, oracle),
           lambda: paged_attention_triton(q, kc, vc, meta, scale, window),
           lambda: paged_attention_ref(q, kcz_lo, vcz_lo, meta, scale, window),
           nbytes=kv_bytes + 2 * q.numel() * q.element_size(), flops=flops, extra_ok=stable)
    if not stable:
        print("   results differ between two runs on the same inputs")
    if name.startswith(("decode B64", "decode B2 ", "decode B1 ", "prefill 1x", "prefill chunk", "mixed 3")) \
            and BENCH and dtype == torch.bfloat16:
        sweep(name, q, kc, vc, meta, scale, window, oracle, kv_bytes, flops)
    t_tok = k.shape[0]
    kv_new = 2 * 2 * t_tok * hkv * d * k.element_size()
    record("store_kv", name, dtype, 0.0 if store_ok else float("inf"), 0.0,
           lambda: store_kv_triton(k, v, kc, vc, meta.slot_mapping),
           lambda: store_kv_ref(k, v, kc_ref, vc_ref, meta.slot_mapping), nbytes=kv_new)


def sweep(name, q, kc, vc, meta, scale, window, oracle, kv_bytes, flops):
    """Times tile configs (graph replay) next to the default, each checked against the oracle too."""
    from lamina.kernels.triton_attention import decode_num_splits

    if name.startswith("decode"):
        splits = decode_num_splits(meta.num_seqs, kc.shape[2], q.device)
        configs = [dict(), dict(num_splits=max(2, splits // 2)), dict(num_splits=min(128, 2 * splits)),
                   dict(tune=dict(decode_block_n=64)), dict(tune=dict(decode_stages=3))]
    else:
        shapes = ((128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (128, 32, 8, 2))  # BLOCK_M, BLOCK_N, warps, stages
        configs = [dict()] + [dict(tune=dict(prefill_block_m=m, prefill_block_n=n, prefill_warps=w,
                                             prefill_stages=st)) for m, n, w, st in shapes]
    for cfg in configs:
        try:
            fn = lambda: paged_attention_triton(q, kc, vc, meta, scale, window, **cfg)  # noqa: B023 (used in this iteration)
            err = rel_err(paged_attention_triton(q, kc, vc, meta, scale, window, out=nan_like(q), **cfg), oracle)
            t = bench_graph(fn)
            label = " ".join(f"{k.replace('prefill_', '')}={v}" for k, v in
                             {**{"splits": cfg.get("num_splits")}, **cfg.get("tune", {})}.items() if v) or "default"
            print(f"     sweep {name[:22]:22s} {label:40s} err={err:.1e} {t:8.1f} us {kv_bytes / t / 1e3:6.0f} GB/s "
                  f"{flops / t / 1e6:5.0f} TFLOP/s", flush=True)
            if err > TOL[q.dtype]:
                FAILED.append(f"sweep {name} {cfg}")
        except Exception as e:  # a config that does not fit is a finding, not a failure of the kernels
            print(f"     sweep {name} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)


def attention_cases():
    if OPTS.interpret:
        return [
            ("decode G4 d64", [(1, 37), (1, 5), (1, 100)], 8, 2, 64, None),
            ("decode G1 d64 splits", [(1, 300)], 2, 2, 64, None),
            ("decode G8 d128 window", [(1, 90), (1, 17)], 8, 1, 128, 20),
            ("prefill G4 d64", [(20, 20), (35, 50)], 4, 1, 64, None),
            ("mixed G2 d64", [(1, 30), (9, 40), (1, 3), (17, 17)], 4, 2, 64, None),
            ("mixed G7 d128 window", [(1, 60), (12, 40)], 7, 1, 128, 9),
            ("prefill chunk G2 d64", [(70, 300), (130, 130)], 4, 2, 64, None),
            ("prefill window G1 d64", [(100, 400), (1, 200)], 2, 2, 64, 70),
        ]
    rng = torch.Generator().manual_seed(OPTS.seed + 1)

    def lens(n, lo, hi):
        return torch.randint(lo, hi, (n,), generator=rng).tolist()

    return [
        ("decode B64 ctx<4k G4 d128", [(1, s) for s in lens(64, 500, 4000)], 32, 8, 128, None),
        ("decode B2 ctx32k G8 d128", [(1, 32768), (1, 32001)], 32, 4, 128, None),
        ("decode B1 ctx8k G1 d64", [(1, 8192)], 16, 16, 64, None),
        ("decode B8 ctx6k G4 win1024", [(1, s) for s in lens(8, 4000, 8000)], 32, 8, 128, 1024),
        ("decode B256 ctx<2k G8 d128", [(1, s) for s in lens(256, 100, 2000)], 32, 4, 128, None),
        ("prefill 1x4096 G4 d128", [(4096, 4096)], 32, 8, 128, None),
        ("prefill chunk 2x1024 ctx8k G8", [(1024, 4096), (1024, 8024)], 32, 4, 128, None),
        ("prefill varlen G1 d64", [(200, 200), (777, 900), (1500, 1500)], 12, 12, 64, None),
        ("mixed 3 prefill + 40 decode G8", [(300, 900), (700, 700), (33, 5000)]
         + [(1, s) for s in lens(40, 100, 9000)], 32, 4, 128, None),
        ("mixed window512 G4 d64", [(1, s) for s in lens(10, 10, 3000)] + [(600, 2000), (129, 129)],
         16, 4, 64, 512),
        ("mixed G7 d128", [(1, 3000), (64, 1000), (1, 17)], 28, 4, 128, None),
    ]


def run_attention():
    for i, (name, specs, hq, hkv, d, window) in enumerate(attention_cases()):
        # The interpreter computes bf16 dots on raw bits (Triton 3.6), so on a CPU bf16 attention is skipped.
        # bf16 everywhere; fp16 and fp32 on every third case (each dtype/shape is one more compile).
        dtypes = [torch.float16] if OPTS.interpret else [torch.bfloat16]
        if not OPTS.interpret and i % 3 == 0:
            dtypes.append(torch.float16)
        small = sum(s for _, s in specs) * hkv * d <= 40_000_000 and max(q for q, _ in specs) <= 2048
        if OPTS.interpret or (small and i % 3 == 1):
            dtypes.append(torch.float32)
        for dt in dtypes:
            check_attention(name, specs, hq, hkv, d, dt, window, seed=OPTS.seed * 100 + i)


# ---------------------------------------------------------------- elementwise ops


def check_norms(dtype, t, h, offset, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype).to(DEV)
    r = torch.randn(t, h, generator=gen).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).to(DEV)
    eps = 1e-6
    name = f"{t}x{h} off={offset}"
    out = rms_norm_triton(x, w, eps, offset, out=nan_like(x))
    oracle = rms_norm_ref(x.double(), w.double(), eps, offset)
    nb = 2 * x.numel() * x.element_size()
    record("rms_norm", name, dtype, rel_err(out, oracle), rel_err(rms_norm_ref(x, w, eps, offset), oracle),
           lambda: rms_norm_triton(x, w, eps, offset), lambda: rms_norm_ref(x, w, eps, offset), nbytes=nb)
    x0, r0 = x.clone(), r.clone()
    normed, summed = fused_add_rms_norm_triton(x, r, w, eps, offset, out=nan_like(x), sum_out=nan_like(x))
    untouched = torch.equal(x, x0) and torch.equal(r, r0)
    on, osum = fused_add_rms_norm_ref(x.double(), r.double(), w.double(), eps, offset)
    rn, rs = fused_add_rms_norm_ref(x, r, w, eps, offset)
    err = max(rel_err(normed, rms_norm_ref(rs.double(), w.double(), eps, offset)), rel_err(summed, osum))
    record("add_norm", name, dtype, err, max(rel_err(rn, on), rel_err(rs, osum)),
           lambda: fused_add_rms_norm_triton(x, r, w, eps, offset),
           lambda: fused_add_rms_norm_ref(x, r, w, eps, offset), nbytes=2 * nb, extra_ok=untouched)


def check_rope(dtype, t, hq, hk, d, rot, seed):
    gen = torch.Generator().manual_seed(seed)
    inv, factor = rope_inv_freq(rot, 1e6, None)
    cs = rope_cos_sin_cache(inv, 65536, factor).to(DEV)
    pos = torch.randint(0, 65536, (t,), generator=gen).to(DEV)
    # q and k as views into one fused qkv row, as the attention layer produces them.
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype).to(DEV)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    v_before = qkv[:, (hq + hk) * d:].clone()
    oq, ok_ = apply_rope_ref(q.double(), k.double(), pos, cs.double())
    rq, rk = apply_rope_ref(q, k, pos, cs)
    q2, k2 = apply_rope_triton(q, k, pos, cs)
    err = max(rel_err(q2, oq), rel_err(k2, ok_))
    same = q2.data_ptr() == q.data_ptr() and torch.equal(qkv[:, (hq + hk) * d:], v_before)
    nb = 2 * t * (hq + hk) * rot * qkv.element_size() + t * rot * 4
    record("rope", f"{t}tok q{hq} k{hk} d{d} rot{rot}", dtype, err, max(rel_err(rq, oq), rel_err(rk, ok_)),
           lambda: apply_rope_triton(q, k, pos, cs), lambda: apply_rope_ref(q, k, pos, cs), nbytes=nb,
           extra_ok=same)


def check_silu(dtype, t, inter, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(t, 2 * inter, generator=gen)).to(dtype).to(DEV)
    out = silu_and_mul_triton(x, out=torch.full((t, inter), float("nan"), dtype=dtype, device=DEV))
    oracle = silu_and_mul_ref(x.double())
    record("silu_mul", f"{t}x{inter}", dtype, rel_err(out, oracle), rel_err(silu_and_mul_ref(x), oracle),
           lambda: silu_and_mul_triton(x), lambda: silu_and_mul_ref(x), nbytes=3 * t * inter * x.element_size())


def run_elementwise():
    small = OPTS.interpret
    for i, dt in enumerate([torch.bfloat16, torch.float16, torch.float32]):
        s = OPTS.seed * 100 + i
        check_norms(dt, 37 if small else 8192, 96 if small else 4096, 0.0, s)
        check_norms(dt, 50 if small else 8192 * 32, 128, 1.0, s + 10)  # per-head q/k norm, Gemma offset
        check_norms(dt, 5 if small else 300, 5000, 0.0, s + 20)  # width not a power of two
        check_rope(dt, 9 if small else 8192, 4 if small else 32, 2 if small else 8, 64 if small else 128,
                   64 if small else 128, s + 30)
        check_rope(dt, 7 if small else 8192, 3 if small else 16, 1 if small else 4, 80 if small else 128,
                   40 if small else 64, s + 40)  # partial rotary
        check_silu(dt, 6 if small else 8192, 100 if small else 14336, s + 50)
        check_silu(dt, 3 if small else 17, 1000, s + 60)


def ceilings():
    import triton.testing

    src = torch.randn(256 * 2**20, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    tm = triton.testing.do_bench(lambda: a @ a, return_mode="median")
    print(f"ceilings: copy {2 * src.numel() * 4 / t / 1e6:.0f} GB/s (read+write), "
          f"bf16 matmul {2 * 8192**3 / tm / 1e9:.0f} TFLOP/s", flush=True)


def main() -> int:
    torch.manual_seed(OPTS.seed)
    if BENCH:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
        ceilings()
    run_elementwise()
    run_attention()
    print("\nkernel      case                                dtype  rel_err   ref_err  graph_us  eager_us    ref_us"
          "  speedup   GB/s  TFLOP/s")
    for r in ROWS:
        if "t_us" not in r:
            continue
        print(f"{r['kernel']:11s} {r['case'][:35]:35s} {r['dtype']:5s} {r['err']:8.1e}  {r['ref_err']:8.1e} "
              f"{r['t_us']:9.1f} {r['eager_us']:9.1f} {r['ref_us']:9.1f} {r['ref_us'] / r['t_us']:7.1f}x "
              f"{r['gbs']:6.0f} {r['tflops']:7.1f}")
    worst = {}
    for r in ROWS:
        if r["err"] == r["err"]:
            key = (r["kernel"], r["dtype"])
            worst[key] = max(worst.get(key, 0.0), r["err"])
    print("\nworst rel_err per kernel/dtype: "
          + ", ".join(f"{k}/{d}={e:.1e}" for (k, d), e in sorted(worst.items())))
    n = sum(1 for r in ROWS if r["err"] == r["err"])
    print(f"{n - len(FAILED)}/{n} checks passed" + (f"; FAILED: {FAILED}" if FAILED else ""))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
