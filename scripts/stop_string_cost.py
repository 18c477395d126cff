"""What stop strings cost the engine's step loop (CPU, real tokenizer): host time per step spent resolving
the step's tokens (LLMEngine._resolve: appending, stop checks and, before the output side took them over,
detokenization and stop-string matching), and the whole step, for B plain greedy requests alone and next
to one request carrying the most stop strings allowed (32 x 256 characters, never matching). Where the
output processor exists, its own time per step is reported too (it runs in the API server process).

    python scripts/stop_string_cost.py [--model smollm2-135m-instruct] [--batch 16] [--steps 60]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from lamina.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, SamplingParams


def _measure(eng: LLMEngine, batch: int, steps: int, stops: list[str] | None, tag: str) -> dict:
    try:
        from lamina.engine.output_processor import OutputProcessor
        proc = OutputProcessor(eng.tokenizer)
    except ImportError:  # before the move: the engine made the text itself
        proc = None
    resolve_times: list[float] = []
    inner = eng._resolve

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            resolve_times.append(time.perf_counter() - t)

    eng._resolve = timed
    plain = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(batch)]
    for rid in rids:
        eng.add_request(rid, {"prompt_token_ids": [1000 + 17 * i for i in range(32)]}, plain)
        if proc is not None:
            proc.add(rid, plain)
    if stops is not None:
        p = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True, stop=stops)
        eng.add_request(f"{tag}-stops", {"prompt_token_ids": [1000 + 17 * i for i in range(32)]}, p)
        rids.append(f"{tag}-stops")
        if proc is not None:
            proc.add(f"{tag}-stops", p)
    for _ in range(3):  # prefill and warm-up
        eng.step()
    resolve_times.clear()
    step_times, proc_times = [], []
    for _ in range(steps):
        t = time.perf_counter()
        outs = eng.step()
        step_times.append(time.perf_counter() - t)
        if proc is not None:
            t = time.perf_counter()
            for out in outs:
                proc.process(out)
            proc_times.append(time.perf_counter() - t)
    for rid in rids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    eng._resolve = inner
    res = {"resolve_ms_median": 1e3 * statistics.median(resolve_times),
           "step_ms_median": 1e3 * statistics.median(step_times)}
    if proc_times:
        res["output_side_ms_median"] = 1e3 * statistics.median(proc_times)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    eng = LLMEngine(EngineConfig(model=args.model, max_model_len=512, num_kv_blocks=256), progress=False)
    eng.stream_outputs = True  # as behind the server: every step's progress
    rng = random.Random(0)
    stops = ["".join(rng.choice("etaoin ") for _ in range(MAX_STOP_STRING_LEN))
             for _ in range(MAX_STOP_STRINGS)]
    with torch.inference_mode():
        _measure(eng, args.batch, 5, None, "warm")
        result = {"batch": args.batch, "plain": _measure(eng, args.batch, args.steps, None, "a"),
                  "with_stop_request": _measure(eng, args.batch, args.steps, stops, "b")}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
