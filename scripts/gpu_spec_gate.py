#!/usr/bin/env python3
"""The goodput gate on the GPU (issue 14, spec/goodput.py): random Qwen3-8B (bf16, CUDA graphs, K = 3), the
bench-only replay proposer with forced acceptance p (each verify step's accepted count is the proposer's
decision: the device work of a real verify step at acceptance p), at batch 1 and 64 concurrent requests
(128 prompt / 128 output tokens), p in {0.8, 0.0, 0.5}, gate "off" (draft every step) against the default gate
("goodput"), each against plain decoding measured in the same engine (same weights, graphs and pool).

Each run is a warm-up pass then a timed pass of fresh prompts with the same speculative decoder, so the goodput
gate enters the timed pass with what it learned in the warm-up (as a server's would: its verdicts outlive
requests); the timed pass's verify and plain steps are counted, with the gate's verdict changes, the
per-sequence acceptance pauses and the gate's estimated speed-up per batch bucket. Expected: at batch 1 and
p = 0.8 both near the forced stage's ~2x; at p = 0.5 goodput near gate off (issue 14: it was 1.13x / 1.01x
plain against 1.62x / 1.38x, turning drafting off); at p = 0, gate off loses and goodput stays within ~5% of
plain; where speculation loses at 64 even at p = 0.8 or 0.5, goodput turns it off.

    OUT=dir python scripts/gpu_spec_gate.py [--batches 1,64] [--ps 0.8,0.0,0.5]
    python scripts/gpu_spec_gate.py --cpu-smoke     # toy preset on the CPU: the logic, no figures
Writes spec_gate.json under $OUT and prints one line per run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path


def _pass(llm, prompts, output_len, shift):
    import torch

    from lamina import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": [(p[0] + shift) % 1000] + p[1:]} for p in prompts]  # no prefix-cache hits
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = llm.generate(batch, params, use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, [r.outputs[0].token_ids for r in res]


def run(llm, prompts, output_len) -> dict:
    """A warm-up pass, then a timed pass; the engine's speculative decoder (if any) is kept across both."""
    _pass(llm, prompts, output_len, 1)
    spec = llm.engine.spec
    before = (spec.num_verify_steps, spec.num_plain_steps) if spec is not None else (0, 0)
    elapsed, out = _pass(llm, prompts, output_len, 0)
    r = {"elapsed_s": elapsed, "output_tok_s": len(prompts) * output_len / elapsed, "outputs": out}
    if spec is not None:
        r.update(verify_steps=spec.num_verify_steps - before[0], plain_steps=spec.num_plain_steps - before[1],
                 goodput_offs=spec.goodput.num_offs if spec.goodput else None,
                 goodput_ons=spec.goodput.num_ons if spec.goodput else None,
                 seq_pauses=spec.gate.num_pauses,  # per-sequence acceptance pauses (spec/adaptive.py), cumulative
                 goodput_speedup={k: round(v, 3) for k in (spec.goodput.buckets if spec.goodput else ())
                                  if (v := spec.goodput.speedup(k)) is not None})
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ps", default="0.8,0.0,0.5")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    if args.cpu_smoke:
        os.environ["SPEC_BENCH_SMOKE"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from spec_bench_models import DENSE, K, cut, device_args

    from lamina import LLM
    from lamina.spec.config import parse_speculative_config
    from lamina.spec.decoder import SpecDecoder

    batches = [int(b) for b in args.batches.split(",")]
    ps = [float(p) for p in args.ps.split(",")]
    if args.cpu_smoke:
        batches, args.input_len, args.output_len = [1, 4], 8, 24
        torch.set_num_threads(1)
    cpu = bool(device_args())
    base = {"method": "replay", "num_speculative_tokens": K, "acceptance_prob": 0.0, "forced": True}
    torch.manual_seed(0)
    t0 = time.perf_counter()
    llm = LLM(model=cut(DENSE, None), dtype="float32" if cpu else "bfloat16", kv_cache_memory_gb=0.05 if cpu else 8,
              max_num_seqs=max(batches), max_num_batched_tokens=2048, progress=False,
              speculative_config=parse_speculative_config({**base, "gate": "off"}, bench=True),
              **({"device": "cpu"} if cpu else {}))
    eng = llm.engine
    proposer = eng.spec.proposer
    eng.spec = None
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    prompts = [[rng.randrange(1000, vocab) for _ in range(args.input_len)] for _ in range(max(batches))]
    result = {"model": cut(DENSE, None), "k": K, "start_s": round(time.perf_counter() - t0, 1),
              "cuda_graphs": eng.runner.graphs is not None, "input_len": args.input_len,
              "output_len": args.output_len, "runs": {}}
    for b in batches:
        eng.spec = None
        plain = run(llm, prompts[:b], args.output_len)
        proposer.reference.update({tuple([(p[0] + w) % 1000] + p[1:]): o for p, o in zip(prompts[:b],
                                   plain.pop("outputs")) for w in (0, 1)})
        result["runs"][f"plain_b{b}"] = plain
        print(f"plain b{b}: {plain['output_tok_s']:.1f} tok/s", flush=True)
        for p in ps:
            proposer.p = p
            for gate in ("off", "goodput"):
                cfg = {**base, "acceptance_prob": p, "gate": gate}
                if gate == "off":
                    cfg["min_acceptance_rate"] = 0
                eng.spec = SpecDecoder(parse_speculative_config(cfg, bench=True), proposer)  # a fresh gate
                r = run(llm, prompts[:b], args.output_len)
                r["outputs_differing"] = sum(a != o for a, o in zip(r.pop("outputs"), (proposer.reference[
                    tuple([pr[0] % 1000] + pr[1:])] for pr in prompts[:b])))
                r["speedup"] = plain["elapsed_s"] / r["elapsed_s"]
                result["runs"][f"p{p}_{gate}_b{b}"] = r
                print(f"p={p} gate={gate:7s} b{b}: {r['output_tok_s']:.1f} tok/s = {r['speedup']:.2f}x plain; "
                      f"timed pass: {r['verify_steps']} verify / {r['plain_steps']} plain steps; goodput "
                      f"offs/ons {r['goodput_offs']}/{r['goodput_ons']}; seq pauses {r['seq_pauses']}; gate's estimate "
                      f"{r['goodput_speedup']}", flush=True)
        eng.spec = None
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_gate.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
