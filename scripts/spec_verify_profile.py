#!/usr/bin/env python3
"""Op-by-op GPU time of one hybrid verify forward (K + 1 = 4 tokens per sequence) against one decode forward,
batch 1, eager (the profiler sees each kernel; graphs only hide launch gaps): what besides the routed experts'
distinct bytes makes the verify forward ~2x the decode forward (issue 14: target <= 1.25x).

1. Check first, on the GPU: greedy with the replay proposer at p = 1 (every draft is the plain run's own
   token) must reproduce the plain run (a bf16 near-tie on random weights may flip a late token: reported,
   a divergence before token 8 fails the stage).
2. Profile: the 3rd decode forward of a plain run and the 3rd verify forward of the speculative run, each
   under torch.profiler (CUDA activity), plus the synchronized wall time of 5 more of each kind.
   CPU smoke run: SPEC_BENCH_SMOKE=1 (toy preset, host ops).
Prints kernels grouped by kind (gdn, conv, attention, moe, gemm, norm/rope/act, other) with decode us, verify
us and the ratio, then the 25 kernels that cost the verify forward most; JSON to $OUT/spec_verify_profile.json.

Candidates from the code, besides the routed experts' distinct bytes (what the table should confirm or not):
- attention: a T = 4 row is not a decode row (attention_launch.py), so the verify step runs the varlen
  prefill kernel without the decode kernel's split-K over the context: few programs at batch 1;
- GDN verify (triton_gdn_verify.py): the state is written after every token (K + 1 = 4 fp32 state writes
  against 1), reads the same; grid as decode, so its time should scale with the writes only;
- MoE at T = 4 (triton_moe_decode.py): gate|up per (token, slot) pair and the down-sum per token, so an
  expert two tokens share is streamed twice (bytes ~ T x top_k, not the distinct experts);
- conv verify (triton_conv1d_verify.py): a second launch per layer for the candidates' conv states.

    python scripts/spec_verify_profile.py [--layers 8] [--input-len 512] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from spec_bench_models import HYBRID, K, cut

GROUPS = [("gdn", ("gdn", "delta", "recurrent", "chunk_")), ("conv", ("conv",)),
          ("attention", ("attn", "attention", "flash", "paged", "sdpa")), ("moe", ("moe", "expert", "topk", "router")),
          ("gemm", ("gemm", "matmul", "cutlass", "sm90", "gemv", "cublas", "nvjet", "splitk")),
          ("norm/rope/act", ("norm", "rope", "rotary", "silu", "sigmoid", "softplus", "gelu"))]


def group_of(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k in low for k in keys):
            return g
    return "other"


CUDA = torch.cuda.is_available()  # else the CPU smoke run (SPEC_BENCH_SMOKE=1): host ops, host time


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def kernel_times(prof) -> dict[str, float]:
    """Self device time (us) per kernel name of one profiled forward (CPU smoke run: self CPU time per op)."""
    out: dict[str, float] = {}
    for a in prof.key_averages():
        if CUDA:
            t = getattr(a, "self_device_time_total", None)
            if t is None:
                t = getattr(a, "self_cuda_time_total", 0.0)
            if not ("CUDA" in str(getattr(a, "device_type", "")) or t):
                continue
        else:
            t = a.self_cpu_time_total
        if t:
            out[a.key] = out.get(a.key, 0.0) + float(t)
    return out


class ForwardProbe:
    """Wraps runner.execute: profiles the nth forward of the wanted kind (decode: 1 token a sequence; verify:
    K + 1), and times later ones with CUDA events."""

    def __init__(self, runner, nth: int = 3, timed: int = 5) -> None:
        self.runner, self.orig = runner, runner.execute
        self.nth, self.timed, self.kind = nth, timed, None
        self.seen, self.profile, self.times = 0, None, []
        runner.execute = self.execute

    def execute(self, batch):
        want = {"decode": 1, "verify": K + 1}.get(self.kind)
        if want is None or batch.attn.max_query_len != want or len(batch.attn.seq_lens_cpu) != 1:
            return self.orig(batch)
        self.seen += 1
        if self.seen == self.nth:
            _sync()
            act = torch.profiler.ProfilerActivity
            with torch.profiler.profile(activities=[act.CUDA if CUDA else act.CPU]) as prof:
                out = self.orig(batch)
                _sync()
            self.profile = kernel_times(prof)
            return out
        if self.nth < self.seen <= self.nth + self.timed:
            _sync()
            t0 = time.perf_counter()
            out = self.orig(batch)
            _sync()  # one forward, launched and finished: its wall time is its device time (eager, batch 1)
            self.times.append(1e6 * (time.perf_counter() - t0))
            return out
        return self.orig(batch)

    def take(self, kind: str) -> tuple[dict[str, float] | None, float | None]:
        prof, times = self.profile, self.times
        self.kind, self.seen, self.profile, self.times = kind, 0, None, []
        return prof, (statistics.median(times) if times else None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8, help="layers of the hybrid shape (3 GDN : 1 attention)")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens (attention's context)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from lamina import LLM, SamplingParams
    from lamina.spec.config import parse_speculative_config

    model = cut(HYBRID, args.layers)
    spec = parse_speculative_config({"method": "replay", "num_speculative_tokens": K, "acceptance_prob": 1.0,
                                     "min_acceptance_rate": 0}, bench=True)
    dev = {"device": "cpu", "dtype": "float32"} if os.environ.get("SPEC_BENCH_SMOKE") == "1" else {}
    llm = LLM(model=model, **dev, enforce_eager=True, speculative_config=spec, max_num_seqs=4, progress=False)
    eng = llm.engine
    prompt = [{"prompt_token_ids": [(7 * i + 11) % 30000 + 100 for i in range(args.input_len)]}]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    probe = ForwardProbe(eng.runner)
    saved, eng.spec = eng.spec, None
    probe.take("decode")
    ref = list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    dec_prof, dec_us = probe.take("verify")
    eng.spec = saved
    saved.proposer.reference[tuple(prompt[0]["prompt_token_ids"])] = ref
    got = list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    ver_prof, ver_us = probe.take("none")
    diverge = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    check = {"identical": got == ref, "first_divergence": diverge, "ok": diverge is None or diverge >= 8}
    print(f"check: speculative greedy vs plain: identical {check['identical']}, first divergence {diverge}")
    res = {"model": model, "layers": args.layers, "check": check, "decode_us": dec_us, "verify_us": ver_us}
    if dec_prof is None or ver_prof is None:
        print("no decode or verify forward was profiled (too few steps?)")
        res["error"] = "not profiled"
    else:
        groups: dict[str, list[float]] = {}
        for prof, col in ((dec_prof, 0), (ver_prof, 1)):
            for name, t in prof.items():
                groups.setdefault(group_of(name), [0.0, 0.0])[col] += t
        total = [sum(g[0] for g in groups.values()), sum(g[1] for g in groups.values())]
        print(f"forward (synced wall, median of 5): decode {dec_us:.0f} us, verify {ver_us:.0f} us, "
              f"ratio {ver_us / dec_us:.2f} (target <= 1.25)")
        print(f"{'group':14s} {'decode us':>10s} {'verify us':>10s} {'ratio':>6s} {'extra us':>9s}")
        for g, (d, v) in sorted(groups.items(), key=lambda kv: kv[1][0] - kv[1][1]):
            print(f"{g:14s} {d:10.1f} {v:10.1f} {v / d if d else float('inf'):6.2f} {v - d:9.1f}")
        print(f"{'kernels':14s} {total[0]:10.1f} {total[1]:10.1f} {total[1] / max(total[0], 1e-9):6.2f}")
        top = sorted(ver_prof.items(), key=lambda kv: -(kv[1] - dec_prof.get(kv[0], 0.0)))[:25]
        print("kernels by extra verify time (verify us, decode us, name):")
        for name, v in top:
            print(f"  {v:9.1f} {dec_prof.get(name, 0.0):9.1f}  {name[:110]}")
        res.update(groups={g: {"decode_us": d, "verify_us": v} for g, (d, v) in groups.items()},
                   decode_kernels=dec_prof, verify_kernels=ver_prof)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "spec_verify_profile.json").write_text(json.dumps(res, indent=1))
    return 0 if check["ok"] and "error" not in res else 1


if __name__ == "__main__":
    raise SystemExit(main())
