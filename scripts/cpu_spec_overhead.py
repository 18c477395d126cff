#!/usr/bin/env python3
"""What speculation costs when it never pays, on the CPU: the built-in SmolLM2 (or --model), N concurrent
random-token prompts (n-gram lookup finds next to nothing in them), greedy, the same prompts through one engine
per configuration in this process: speculation off, ngram with the default gates (per sequence and batch-wide),
ngram with the gates off. The step loop overlaps (async_scheduling on) in every configuration, as on a GPU.

    python scripts/cpu_spec_overhead.py [--num-prompts 16] [--input-len 32] [--output-len 32] [--model M]
Prints one JSON line per configuration (tokens/s, ratio to off, drafts, acceptance, pauses).
"""
from __future__ import annotations

import argparse
import json
import random
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()

    from lamina import LLM, SamplingParams

    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    configs = {"off": None, "ngram (default gates)": ngram, "ngram (gates off)": {**ngram, "min_acceptance_rate": 0}}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    base = None
    for name, spec in configs.items():
        kw = {"model": args.model} if args.model else {}
        llm = LLM(**kw, device="cpu", speculative_config=spec, async_scheduling=True,
                  max_num_seqs=args.num_prompts, progress=False)
        rng = random.Random(0)
        vocab = llm.engine.model_config.vocab_size
        prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
        elapsed = 0.0
        for warm in (True, False):  # a warm-up pass with other first tokens (no prefix-cache hits), then timed
            batch = [{"prompt_token_ids": [p[0] + (1 if warm else 0)] + p[1:]} for p in prompts]
            t0 = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
        st = llm.engine.stats()
        tok_s = args.num_prompts * args.output_len / elapsed
        base = base or tok_s
        print(json.dumps({"config": name, "tok_s": round(tok_s, 2), "vs_off": round(tok_s / base, 3),
                          "drafts": st.num_spec_draft_tokens, "accepted": st.num_spec_accepted_tokens,
                          "seq_pauses": st.num_spec_pauses, "batch_pauses": st.num_spec_batch_pauses}), flush=True)
        del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
