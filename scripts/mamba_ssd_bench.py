"""Mamba-2 SSD kernels on the GPU: the Triton chunked scan vs the torch chunked reference for one long prompt, and
the decode state update at several batch sizes, at a Nemotron-H 8B mixer's shape (HF NemotronHConfig defaults:
128 heads x head_dim 64, 8 groups, state 128, chunk 128), bf16 activations, fp32 states. Prints one JSON object.

  python scripts/mamba_ssd_bench.py                  # CUDA: checks + timings (+ tile sweeps with --sweep)
  python scripts/mamba_ssd_bench.py --ptxas          # no GPU needed: registers / spills / smem for sm_90a
  python scripts/mamba_ssd_bench.py --smoke          # no GPU: every path through Triton's interpreter, tiny shapes
  python scripts/mamba_ssd_bench.py --prefill-only   # CUDA: the chunked-scan prefill vs its torch reference only

Every timed call is checked against the torch reference on the same inputs first (relative L2 error of y and of
the states). Each timing is the median over iterations, each one after an L2 flush (the states and inputs are
otherwise L2-resident at small batches, which no real step sees). Decode bandwidth counts the state read + write
(the traffic that matters) plus x, B, C, dt, y; the H200's peak is about 4.8 TB/s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lamina.kernels.mamba_ssd import mamba_ssd_varlen_ref  # noqa: E402

H, P, G, N, CHUNK = 128, 64, 8, 128, 128  # Nemotron-H 8B's mixer
PEAK_BW = 4.8e12
DEV = "cuda"
DTYPE = torch.bfloat16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _inputs(t: int, seed: int = 0):
    """x, B, C as views of one conv1d output row [T, H P + 2 G N] (as the layer hands them over), raw dt [T, H],
    parameters with Mamba-2's init magnitudes."""
    gen, dtype = torch.Generator(device=DEV).manual_seed(seed), DTYPE
    xbc = torch.randn(t, H * P + 2 * G * N, device=DEV, generator=gen).to(dtype)
    x = xbc[:, :H * P].unflatten(1, (H, P))
    B = xbc[:, H * P:H * P + G * N].unflatten(1, (G, N))
    C = xbc[:, H * P + G * N:].unflatten(1, (G, N))
    dt = (0.5 * torch.randn(t, H, device=DEV, generator=gen)).to(dtype)
    a_log = torch.log(1 + 15 * torch.rand(H, device=DEV, generator=gen))
    step = torch.exp(torch.empty(H, device=DEV).uniform_(-6.9, -2.3, generator=gen))
    dt_bias = step + torch.log(-torch.expm1(-step))
    D = torch.randn(H, device=DEV, generator=gen)
    return x, dt, a_log, B, C, D, dt_bias


class Timer:
    def __init__(self):
        self.cuda = DEV == "cuda"
        self.flush = torch.empty(256 << 20 if self.cuda else 1, dtype=torch.uint8, device=DEV)

    def __call__(self, fn, iters: int = 20, warmup: int = 3) -> float:
        """Median milliseconds of fn() over iters calls, each after an L2 flush (smoke runs: one untimed call)."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            self.flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        times.sort()
        return times[len(times) // 2]


def bench_prefill(timer: Timer, t: int, sweep: bool) -> dict:
    from lamina.kernels.triton_mamba_ssd_chunk import ssd_chunked_triton

    x, dt, a_log, B, C, D, dt_bias = _inputs(t)
    qs = torch.tensor([0, t], dtype=torch.int32, device=DEV)
    slots = torch.tensor([1], device=DEV)
    init = torch.tensor([True], device=DEV)
    pool0 = 0.5 * torch.randn(3, H, P, N, device=DEV)
    ref_pool = pool0.clone()
    ref = mamba_ssd_varlen_ref(x.float(), dt.float(), a_log, B.float(), C.float(), D, dt_bias, ref_pool, [0, t], [1],
                               [True], chunk_size=CHUNK)
    res = {"tokens": t}

    def run(tune=None):
        pool = pool0.clone()
        y = ssd_chunked_triton(x, dt, a_log, B, C, D, dt_bias, pool, qs, slots, init, tune=tune)
        return y, pool

    y, pool = run()
    res["rel_err_y"] = _rel(y, ref)
    res["rel_err_state"] = _rel(pool[1], ref_pool[1])
    pool = pool0.clone()
    res["triton_ms"] = timer(lambda: ssd_chunked_triton(x, dt, a_log, B, C, D, dt_bias, pool, qs, slots, init))
    res["triton_tok_s"] = t / res["triton_ms"] * 1e3
    xr, Br, Cr = x.contiguous(), B.contiguous(), C.contiguous()
    res["torch_ref_ms"] = timer(lambda: mamba_ssd_varlen_ref(xr, dt, a_log, Br, Cr, D, dt_bias, pool, [0, t], [1],
                                                             [True], chunk_size=CHUNK), iters=5, warmup=1)
    res["torch_ref_tok_s"] = t / res["torch_ref_ms"] * 1e3
    res["speedup"] = res["torch_ref_ms"] / res["triton_ms"]
    if sweep:
        configs = []  # the state and output kernels' tiles are independent but for bt: vary one at a time
        for bt in (64, 128):
            for sbp, sw in ((32, 4), (32, 8), (64, 4), (64, 8)):  # 16-bit tiles are >= 32 wide
                for sbn in (N, N // 2, N // 4):
                    configs.append(dict(bt=bt, state_bp=sbp, state_warps=sw, state_bn=sbn))
            for obp, ow, bn in ((64, 4, 64), (32, 4, 64), (64, 8, 64), (64, 8, 128)):
                for hpp in (1, 4, H // G, 0):  # 0: output_heads' pick
                    configs.append(dict(bt=bt, out_bp=obp, out_warps=ow, out_bn=bn, out_heads=hpp))
        res["sweep"] = []
        for cfg in configs:
            try:
                y, pool = run(cfg)
                err = _rel(y, ref)
                ms = timer(lambda c=cfg: run(c), iters=10)  # both kernels (+ a pool copy): compare within bt
                res["sweep"].append({**cfg, "ms": ms, "rel_err_y": err})
            except Exception as exc:  # a config that fails to compile or launch is a result too
                res["sweep"].append({**cfg, "error": f"{type(exc).__name__}: {exc}"[:200]})
    return res


def bench_decode(timer: Timer, bsz: int, sweep: bool) -> dict:
    from lamina.kernels.triton_mamba_ssd_decode import ssd_decode_triton

    x, dt, a_log, B, C, D, dt_bias = _inputs(bsz, seed=bsz)
    pool0 = 0.5 * torch.randn(bsz + 1, H, P, N, device=DEV)
    slots = torch.randperm(bsz + 1, device=DEV)[:bsz]
    init = torch.ones(bsz, dtype=torch.bool, device=DEV)
    ref_pool = pool0.clone()
    qs = list(range(bsz + 1))
    ref = mamba_ssd_varlen_ref(x.float(), dt.float(), a_log, B.float(), C.float(), D, dt_bias, ref_pool, qs,
                               slots.tolist(), [True] * bsz)
    pool = pool0.clone()
    y = ssd_decode_triton(x, dt, a_log, B, C, D, dt_bias, pool, slots, init)
    res = {"batch": bsz, "rel_err_y": _rel(y, ref), "rel_err_state": _rel(pool, ref_pool)}
    moved = bsz * (2 * H * P * N * 4 + 2 * (2 * H * P + 2 * G * N + H))
    res["triton_us"] = 1e3 * timer(lambda: ssd_decode_triton(x, dt, a_log, B, C, D, dt_bias, pool, slots, init))
    res["triton_GB_s"] = moved / res["triton_us"] / 1e3
    res["pct_of_peak_bw"] = 100 * moved / (res["triton_us"] * 1e-6) / PEAK_BW
    hs, hi = slots.tolist(), [True] * bsz
    res["torch_ref_us"] = 1e3 * timer(lambda: mamba_ssd_varlen_ref(x, dt, a_log, B, C, D, dt_bias, pool, qs, hs, hi),
                                      iters=10)
    res["speedup"] = res["torch_ref_us"] / res["triton_us"]
    if DEV == "cuda":
        res["graph_replay_ok"] = _graph_check(lambda p: ssd_decode_triton(x, dt, a_log, B, C, D, dt_bias, p, slots,
                                                                          init), pool0)
    if sweep:
        res["sweep"] = []
        for bp, w in ((4, 2), (8, 2), (8, 4), (16, 4), (32, 4), (32, 8), (64, 8)):
            us = 1e3 * timer(lambda b=bp, ww=w: ssd_decode_triton(x, dt, a_log, B, C, D, dt_bias, pool, slots, init,
                                                                  block_p=b, num_warps=ww))
            res["sweep"].append({"block_p": bp, "num_warps": w, "us": us, "GB_s": moved / us / 1e3})
    return res


def bench_verify(timer: Timer, bsz: int = 64, drafts: int = 4) -> dict:
    """A speculative verify step: bsz sequences of 1 + drafts rows, every intermediate state kept."""
    from lamina.kernels.triton_mamba_ssd_decode import ssd_verify_triton

    length = 1 + drafts
    t = bsz * length
    x, dt, a_log, B, C, D, dt_bias = _inputs(t, seed=3)
    n_slots = bsz * length + 1
    pool0 = 0.5 * torch.randn(n_slots, H, P, N, device=DEV)
    perm = torch.randperm(n_slots)
    slots, cands = perm[:bsz], perm[bsz:bsz + bsz * drafts].reshape(bsz, drafts)
    qs = [i * length for i in range(bsz + 1)]
    init = [True] * bsz
    ref_pool = pool0.clone()
    ref = mamba_ssd_varlen_ref(x.float(), dt.float(), a_log, B.float(), C.float(), D, dt_bias, ref_pool, qs,
                               slots.tolist(), init, candidate_slots=cands.tolist())
    dqs, dslots, dcands = (torch.tensor(qs, dtype=torch.int32, device=DEV), slots.to(DEV), cands.to(DEV))
    dinit = torch.ones(bsz, dtype=torch.bool, device=DEV)
    pool = pool0.clone()

    def run():
        return ssd_verify_triton(x, dt, a_log, B, C, D, dt_bias, pool, dqs, dslots, dcands, dinit, length)

    y = run()
    res = {"batch": bsz, "drafts": drafts, "rel_err_y": _rel(y, ref), "rel_err_state": _rel(pool, ref_pool)}
    moved = bsz * (1 + length) * H * P * N * 4  # one state read, one write per token
    res["triton_us"] = 1e3 * timer(run)
    res["triton_GB_s"] = moved / res["triton_us"] / 1e3
    res["torch_ref_us"] = 1e3 * timer(lambda: mamba_ssd_varlen_ref(x, dt, a_log, B, C, D, dt_bias, pool, qs,
                                                                   slots.tolist(), init,
                                                                   candidate_slots=cands.tolist()), iters=3)
    res["speedup"] = res["torch_ref_us"] / res["triton_us"]
    return res


def bench_mixed(timer: Timer, prompt: int = 2048, decodes: int = 255) -> dict:
    """A mixed step: one prompt chunk and `decodes` one-token rows in one chunked launch, against the same rows
    split by sequence (the decode kernel on the one-token rows + the chunked scan on the prompt alone)."""
    from lamina.kernels.triton_mamba_ssd_chunk import ssd_chunked_triton
    from lamina.kernels.triton_mamba_ssd_decode import ssd_decode_triton

    t = prompt + decodes
    x, dt, a_log, B, C, D, dt_bias = _inputs(t, seed=5)
    starts = [0, prompt] + [prompt + i + 1 for i in range(decodes)]
    n = decodes + 1
    pool0 = 0.5 * torch.randn(n + 1, H, P, N, device=DEV)
    qs = torch.tensor(starts, dtype=torch.int32, device=DEV)
    slots = torch.arange(n, device=DEV)
    init = torch.ones(n, dtype=torch.bool, device=DEV)
    ref_pool = pool0.clone()
    ref = mamba_ssd_varlen_ref(x.float(), dt.float(), a_log, B.float(), C.float(), D, dt_bias, ref_pool, starts,
                               slots.tolist(), [True] * n, chunk_size=CHUNK)
    pool = pool0.clone()
    y = ssd_chunked_triton(x, dt, a_log, B, C, D, dt_bias, pool, qs, slots, init)
    res = {"prompt": prompt, "decode_rows": decodes, "rel_err_y": _rel(y, ref), "rel_err_state": _rel(pool, ref_pool)}
    res["one_launch_us"] = 1e3 * timer(lambda: ssd_chunked_triton(x, dt, a_log, B, C, D, dt_bias, pool, qs, slots,
                                                                  init))
    pq = torch.tensor([0, prompt], dtype=torch.int32, device=DEV)
    xs, dts, Bs, Cs = (u[prompt:] for u in (x, dt, B, C))

    def split():
        ssd_chunked_triton(x[:prompt], dt[:prompt], a_log, B[:prompt], C[:prompt], D, dt_bias, pool, pq, slots[:1],
                           init[:1])
        ssd_decode_triton(xs, dts, a_log, Bs, Cs, D, dt_bias, pool, slots[1:], init[1:])

    res["split_us"] = 1e3 * timer(split)
    return res


def _graph_check(step, pool0: torch.Tensor) -> bool:
    """Captures step(pool) in a CUDA graph; the replay must give the eager result bit for bit."""
    eager_pool = pool0.clone()
    want = step(eager_pool).clone()
    pool = pool0.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(pool0.clone())  # warm-up compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(pool)
    pool.copy_(pool0)
    g.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(out, want) and torch.equal(pool, eager_pool))


def bench_mixed_graph() -> dict:
    """The chunked scan captured for a padded mixed step (T rows, S sequence slots), replayed with other lengths."""
    from lamina.kernels.triton_mamba_ssd_chunk import ssd_chunked_triton

    t, s = 512, 8
    x, dt, a_log, B, C, D, dt_bias = _inputs(t, seed=7)
    pool0 = 0.5 * torch.randn(s + 2, H, P, N, device=DEV)
    qs = torch.zeros(s + 1, dtype=torch.int32, device=DEV)
    slots = torch.arange(s, device=DEV)
    init = torch.ones(s, dtype=torch.bool, device=DEV)
    pool = pool0.clone()
    qs.copy_(torch.tensor([0, 100, 101, 102, 300, 301, 302, 303, t], dtype=torch.int32))
    ssd_chunked_triton(x, dt, a_log, B, C, D, dt_bias, pool, qs, slots, init)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ssd_chunked_triton(x, dt, a_log, B, C, D, dt_bias, pool, qs, slots, init)
    ok = True
    for lens in ([1, 1, 1, 200, 7, 1, 1, 300], [512, 0, 0, 0, 0, 0, 0, 0], [64] * 8):
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        qs.copy_(torch.tensor(starts, dtype=torch.int32))
        pool.copy_(pool0)
        g.replay()
        ref_pool = pool0.clone()
        ref = mamba_ssd_varlen_ref(x.float(), dt.float(), a_log, B.float(), C.float(), D, dt_bias, ref_pool, starts,
                                   slots.tolist(), [True] * s, chunk_size=CHUNK)
        ok &= _rel(out, ref) < 2e-2 and _rel(pool[:s], ref_pool[:s]) < 2e-2
    return {"mixed_graph_replay_ok": bool(ok)}


def main() -> None:
    global H, P, G, N, DEV, DTYPE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptxas", action="store_true", help="compile for sm_90a and report registers (no GPU needed)")
    ap.add_argument("--sweep", action="store_true", help="also time tile alternatives")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[4096, 16384])
    ap.add_argument("--decode-batches", type=int, nargs="*", default=[1, 64, 256])
    ap.add_argument("--prefill-only", action="store_true", help="only the chunked-scan prefill checks and timings")
    args = ap.parse_args()
    if args.ptxas:
        from mamba_ssd_ptxas import ptxas_report  # scripts/ is sys.path[0] when this file runs

        print(json.dumps({"ptxas_sm90a": ptxas_report(H, P, G, N)}, indent=1))
        return
    if args.smoke:  # tiny shapes through the interpreter: every code path, no meaningful numbers
        os.environ["TRITON_INTERPRET"] = "1"
        from lamina.kernels.interpreter import patch_triton_interpreter

        patch_triton_interpreter()
        # fp16: the interpreter computes bf16 dots on raw bits (Triton 3.6)
        H, P, G, N, DEV, DTYPE = 4, 16, 2, 16, "cpu", torch.float16
        args.prefill_tokens, args.decode_batches = [150], [1, 3]
    elif not torch.cuda.is_available():
        sys.exit("needs CUDA (or --ptxas / --smoke)")
    timer = Timer()
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter smoke run)",
           "dtype": str(DTYPE)[6:],
           "shape": {"heads": H, "head_dim": P, "groups": G, "state": N},
           "prefill": [bench_prefill(timer, t, args.sweep) for t in args.prefill_tokens]}
    if args.prefill_only:
        print(json.dumps(res, indent=1))
        return
    res.update(decode=[bench_decode(timer, b, args.sweep) for b in args.decode_batches],
               verify=bench_verify(timer, *((3, 2) if args.smoke else ())),
               mixed=bench_mixed(timer, *((40, 5) if args.smoke else ())))
    if DEV == "cuda":
        res.update(bench_mixed_graph())
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
