#!/usr/bin/env python3
"""GPU check: DeepSeek (MLA) mixed prefill+decode steps replayed from CUDA graphs equal eager steps.

A DeepSeek-V2-Lite shape cut to a few layers (random weights), fp32 so that the graph body (every row in the
absorbed form, layers/mla.py _mixed_absorbed) and eager steps (expanded prefill chunks) agree to summation
order: the same prompts, arriving together with a step budget that forces prefill chunks next to decode rows,
through an engine with graphs and one with --enforce-eager. Reports greedy agreement, the max |delta
logprob|, which graph keys the steps replayed (mixed ones must be among them), and both runs' wall time (bf16,
the same workload). Exit 1 when tokens differ or the delta exceeds 1e-3.

    python scripts/mla_graph_check.py [--layers 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(preset: str, dtype: str, eager: bool, prompts: list[list[int]], max_tokens: int, budget: int) -> dict:
    from lamina import LLM, SamplingParams

    torch.manual_seed(0)  # random: presets draw their weights from the global generator: the same twice
    llm = LLM(model=f"random:{preset}", dtype=dtype, device="cuda", progress=False, enforce_eager=eager,
              max_num_batched_tokens=budget, max_num_seqs=len(prompts), enable_prefix_caching=False,
              kv_cache_memory_gb=4)  # a fixed pool: four engines in one process, each sized alike
    keys: list[tuple[int, bool]] = []
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        pick = graphs.pick

        def recorded(batch):
            key = pick(batch)
            if key is not None:
                keys.append((key.tokens, key.decode))
            return key

        graphs.pick = recorded
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    keys.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)] for o in outs]
    if graphs is not None:
        graphs.pick = pick  # breaks the graphs -> recorded -> pick -> graphs cycle, so `del` frees the engine
    llm.engine.close()
    del llm, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return {"tokens": toks, "logprobs": lps, "wall_s": wall, "mixed_keys": sorted({t for t, d in keys if not d}),
            "decode_keys": sorted({t for t, d in keys if d}), "graph_steps": len(keys)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from lamina.models import presets

    name = "deepseek-v2-lite-graphcheck"
    presets.PRESETS[name] = dict(presets.PRESETS["deepseek-v2-lite"], num_hidden_layers=args.layers)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1000, 100000, (int(n),), generator=gen).tolist()
               for n in torch.randint(20, 300, (12,), generator=gen)]
    res: dict = {"preset": name, "layers": args.layers}
    graph = run(name, "float32", False, prompts, 24, 256)
    eager = run(name, "float32", True, prompts, 24, 256)
    agree = sum(a == b for a, b in zip(graph["tokens"], eager["tokens"]))
    delta = max((abs(x - y) for a, b in zip(graph["logprobs"], eager["logprobs"]) for x, y in zip(a, b)),
                default=0.0)
    res["fp32"] = {"sequences_equal": f"{agree}/{len(prompts)}", "max_delta_logprob": delta,
                   "mixed_keys": graph["mixed_keys"], "decode_keys": graph["decode_keys"],
                   "graph_steps": graph["graph_steps"]}
    ok = agree == len(prompts) and delta <= 1e-3 and bool(graph["mixed_keys"])
    fast = run(name, "bfloat16", False, prompts, 24, 256)
    slow = run(name, "bfloat16", True, prompts, 24, 256)
    res["bf16_wall_s"] = {"graphs": fast["wall_s"], "eager": slow["wall_s"], "speedup": slow["wall_s"] / fast["wall_s"]}
    res["passed"] = ok
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
