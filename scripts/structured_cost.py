"""Where structured output's time goes in the engine: offline LLM runs with and without a JSON schema.

For each batch size: the same prompts decoded with and without the schema (greedy, ignore_eos), wall time
per decode step for both, then a cProfile of one constrained run at the largest batch (host functions by
own time). On the H200 the server bench measured TPOT 1.4 -> 2.8 ms at batch 1 and 3.4 -> 56 ms at 64
concurrent with scripts/schemas/bench_items.json; this says which part of the step does it.

  python scripts/structured_cost.py --model CKPT_WITH_TOKENIZER [--batch 1,64] [--output-len 128]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--schema", default="scripts/schemas/bench_items.json")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args()
    from lamina import LLM, SamplingParams
    from lamina.structured.params import StructuredOutputsParams

    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(args.model, progress=False, max_num_seqs=max(batches))
    schema = json.load(open(args.schema))
    prompts = [[1000 + (7 * i + j) % 50000 for j in range(args.prompt_len)] for i in range(max(batches))]

    def run(n: int, constrained: bool) -> float:
        so = StructuredOutputsParams(json=schema) if constrained else None
        sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True, structured_outputs=so)
        llm.generate(prompts[:n], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                 structured_outputs=so), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(prompts[:n], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        return dt / args.output_len * 1e3  # ms per decode step (prefill included, amortized)

    result = {"model": args.model, "output_len": args.output_len, "runs": []}
    for n in batches:
        plain, constrained = run(n, False), run(n, True)
        result["runs"].append({"batch": n, "plain_ms_per_step": plain, "schema_ms_per_step": constrained,
                               "overhead": constrained / plain - 1})
        print(f"batch {n}: {plain:.2f} ms/step plain, {constrained:.2f} with the schema "
              f"({constrained / plain - 1:+.1%})", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    run(max(batches), True)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
    print("RESULT", json.dumps(result))


if __name__ == "__main__":
    main()
