"""`lamina bench prefix`: groups of requests sharing a long system prompt, prefix cache on vs off."""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import torch

from lamina.bench.vllm_baseline import add_vllm_args
from lamina.sampling_params import SamplingParams


def add_prefix_bench_parser(bsub) -> None:
    from lamina.args import add_engine_args

    p = bsub.add_parser("prefix", help="shared-prefix workload with the prefix cache on and off")
    add_engine_args(p)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--baseline", choices=["none", "vllm"], default="none",
                   help="also run vLLM (prefix cache on) on the same requests, in a child process")
    p.add_argument("--result-file", default=None)
    add_vllm_args(p)
    p.set_defaults(func=cmd_prefix)


def _prompts(args, vocab: int, groups: int | None = None, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(groups or args.groups):
        prefix = [rng.randrange(1000, vocab) for _ in range(args.prefix_len)]
        out += [prefix + [rng.randrange(1000, vocab) for _ in range(args.question_len)]
                for _ in range(args.per_group)]
    rng.shuffle(out)  # groups arrive interleaved, as in a real server
    return out


def _warmup_prompts(args, vocab: int) -> list[list[int]]:
    """Prompts of the workload's shapes with other tokens, so nothing of the workload gets cached by them."""
    return _prompts(args, vocab, groups=2, seed=1)[:2 * min(args.per_group, 8)]


def _run(kwargs: dict, args, cache: bool) -> dict:
    from lamina.llm import LLM

    llm = LLM(**{**kwargs, "enable_prefix_caching": cache})
    eng = llm.engine
    eng.stream_outputs = True  # per-request first-token times
    prompts = _prompts(args, eng.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up on the workload's shapes: Triton compiles the kernel variants these batch shapes pick (they are
    # specialized per tile regime) before the clock starts.
    warm = _warmup_prompts(args, eng.model_config.vocab_size)
    llm.generate([{"prompt_token_ids": p} for p in warm],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    first: dict[str, float] = {}
    first_step: dict[str, int] = {}  # engine steps to the first token: the schedule's share of TTFT
    cached = steps = 0
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", {"prompt_token_ids": p}, params)
    while eng.has_unfinished_requests():
        steps += 1
        for out in eng.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start
                first_step[out.request_id] = steps
            if out.finished:
                cached += out.num_cached_tokens
    elapsed = time.perf_counter() - start
    total_prompt = sum(len(p) for p in prompts)
    ttfts = sorted(first.values())
    res = {"prefix_caching": cache, "elapsed_s": elapsed, "prompt_tokens": total_prompt,
           "prefill_tokens_computed": total_prompt - cached, "ttft_median_s": statistics.median(ttfts),
           "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))],
           "ttft_median_steps": statistics.median(first_step.values()), "steps": steps,
           "output_tok_s": len(prompts) * args.output_len / elapsed,
           "snapshot_hits": eng.stats().num_snapshot_hits}  # hybrid models: restored state snapshots
    del llm, eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def cmd_prefix(args: argparse.Namespace) -> int:
    from lamina.args import engine_kwargs
    from lamina.bench import vllm_baseline
    from lamina.bench.common import report

    if args.baseline == "vllm":
        vllm_baseline.require_vllm(args)
    kwargs = engine_kwargs(args)
    on, off = _run(kwargs, args, True), _run(kwargs, args, False)
    result = {"command": "prefix", "model": args.model, "groups": args.groups, "per_group": args.per_group,
              "prefix_len": args.prefix_len, "question_len": args.question_len, "output_len": args.output_len,
              "cache_on": on, "cache_off": off,
              "prefill_reduction": 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"],
              "ttft_median_speedup": off["ttft_median_s"] / on["ttft_median_s"]}
    if args.baseline == "vllm":
        from lamina.engine.memory import resolve_device, resolve_dtype
        from lamina.models.loader import read_config, resolve_source

        vocab = read_config(resolve_source(args.model))[0].vocab_size
        device = resolve_device(args.device)
        vllm_baseline.compare_prefix(result, args, _warmup_prompts(args, vocab), _prompts(args, vocab), device,
                                     resolve_dtype(args.dtype, device))
    report(result, args.result_file)
    return 1 if vllm_baseline.failed(result) else 0
