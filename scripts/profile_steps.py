#!/usr/bin/env python3
"""Where an offline run's wall time goes, step by step: host time, device time and device idle gaps.

Runs `lamina bench throughput`'s workload through the engine with every step timed:
- host: wall time of one `LLMEngine.step()` call (schedule, build, launch, read back the previous step);
- device: CUDA events recorded around the step's launch (input copy, forward, sampling); their elapsed time
  is how long the GPU worked on that step, since the stream runs steps in order;
- gap: from the previous step's end event to this step's start event: time the GPU sat idle waiting for the
  host to launch (0 while the host is ahead).
Steps are grouped by kind (decode-only or mixed with prefill tokens, and whether a CUDA graph was replayed if
the runner says so). Prints one table and writes the per-step rows as JSON (--out).

    python scripts/profile_steps.py --model random:qwen3-0.6b --num-prompts 256 --input-len 100:1024 \
        --output-len 512 --max-num-seqs 256 --max-num-batched-tokens 8192
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from lamina import LLM, SamplingParams
from lamina.bench.workload import make_workload


def _lens(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    return int(lo), int(hi or lo)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", default="100:1024")
    p.add_argument("--output-len", default="512")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--out", default=None, help="write the per-step rows as JSON")
    args = p.parse_args()

    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    wl = make_workload(args.num_prompts, _lens(args.input_len), _lens(args.output_len), vocab, seed=0)
    prompts = [{"prompt_token_ids": q} for q in wl.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    llm.generate(prompts[:8], params[:8])  # warm-up (Triton JIT, graphs)

    cuda = torch.cuda.is_available()
    rows: list[dict] = []
    launch = eng._launch

    def timed_launch(scheduled):
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        if ev:
            ev[0].record()
        out = launch(scheduled)
        if ev:
            ev[1].record()
        rows.append({"seqs": len(scheduled), "tokens": sum(s.num_tokens for s in scheduled),
                     "prefill_tokens": sum(s.num_tokens for s in scheduled if s.num_tokens > s.num_sampled
                                           or not s.num_sampled), "ev": ev, "host_ms": None})
        return out

    eng._launch = timed_launch
    step = eng.step
    host: list[float] = []

    def timed_step():
        n = len(rows)
        t = time.perf_counter()
        out = step()
        dt = (time.perf_counter() - t) * 1e3
        host.append(dt)
        if len(rows) > n:
            rows[-1]["host_ms"] = dt
        return out

    eng.step = timed_step
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0

    prev_end = None
    for r in rows:
        ev = r.pop("ev")
        r["device_ms"] = ev[0].elapsed_time(ev[1]) if ev else None
        r["gap_ms"] = prev_end.elapsed_time(ev[0]) if ev and prev_end is not None else None
        prev_end = ev[1] if ev else None
        r["kind"] = "mixed" if r["prefill_tokens"] else "decode"

    def summary(kind: str, sel: list[dict]) -> str:
        def tot(k):
            return sum(r[k] or 0.0 for r in sel)
        med = statistics.median([r["host_ms"] or 0.0 for r in sel]) if sel else 0.0
        dev = f"{tot('device_ms') / 1e3:7.3f} s" if cuda else "      -"
        gap = f"{tot('gap_ms') / 1e3:7.3f} s" if cuda else "      -"
        return (f"{kind:8s} {len(sel):6d} steps  host {tot('host_ms') / 1e3:7.3f} s (median {med:6.2f} ms)  "
                f"device {dev}  idle gaps {gap}  tokens {int(tot('tokens'))}")

    print(f"wall {wall:.3f} s for {sum(params[i].max_tokens for i in range(len(params)))} output tokens "
          f"({args.model}, {torch.cuda.get_device_name() if cuda else 'CPU'})")
    for kind in ("decode", "mixed"):
        print(summary(kind, [r for r in rows if r["kind"] == kind]))
    print(summary("all", rows))
    rest = sum(host) - sum(r["host_ms"] or 0 for r in rows)
    print(f"steps without a launch (read-back only): {len(host) - len(rows)}, host {rest:.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"wall_s": wall, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
