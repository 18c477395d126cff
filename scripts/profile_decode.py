#!/usr/bin/env python3
"""Where a decode step's time goes: per-kernel device time of eager decode steps (torch.profiler), next to
the CUDA-graph step time of the same engine. A model preset can be cut to fewer layers (per-layer kernels
are the same), so a big shape loads in seconds.

    python scripts/profile_decode.py --model random:qwen3-next-80b-a3b-24l --layers 4 --batch 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lamina import LLM, SamplingParams  # noqa: E402
from lamina.models import presets  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-next-80b-a3b-24l")
    ap.add_argument("--layers", type=int, default=None, help="cut the preset to this many layers")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    model = args.model
    if args.layers and model.startswith("random:"):
        name = model.split(":", 1)[1]
        cfg = dict(presets.PRESETS[name], num_hidden_layers=args.layers)
        presets.PRESETS[f"{name}-cut"] = cfg
        model = f"random:{name}-cut"
    prompts = [{"prompt_token_ids": [1000 + (i * 31 + j) % 5000 for j in range(args.input_len)]}
               for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    for eager in (False, True):
        llm = LLM(model=model, max_num_seqs=max(args.batch, 8), enforce_eager=eager, progress=False,
                  kv_cache_memory_gb=4)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        print(f"{'eager' if eager else 'graph'}: {args.steps} steps in {wall * 1e3:.1f} ms "
              f"(~{wall / args.steps * 1e6:.0f} us/step incl. prefill)")
        if eager:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
            events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or e.self_device_time_total]
            events.sort(key=lambda e: e.self_device_time_total, reverse=True)
            total = sum(e.self_device_time_total for e in events)
            n = sum(e.count for e in events)
            print(f"profiled 1 prefill + 8 decode steps: {n} kernels, {total / 1e3:.2f} ms device time")
            for e in events[: args.top]:
                print(f"{e.self_device_time_total / 1e3:9.3f} ms {e.count:6d}x  {e.key[:110]}")
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
