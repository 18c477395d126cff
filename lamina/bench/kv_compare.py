"""`lamina bench throughput --compare-kv-dtypes`: the same workload through a model-dtype KV pool and an FP8 one,
one engine after the other in this process, with what each pool admitted and the fp8 / model-dtype ratios.

The KV memory should be fixed (--kv-cache-memory-gb): then the FP8 pool holds twice the tokens of a bf16 one,
and on a workload whose contexts fill the pool that shows up as a larger running batch, fewer preemptions and
more tokens per second. Each engine also scores one check prompt (prompt logprobs, prefilled in chunks so the
later chunks attend to KV read back from the pool) so the report carries how far FP8 KV moved them."""
from __future__ import annotations

import argparse

import torch

DTYPES = ("auto", "fp8")  # the model dtype's pool first, then FP8
RATIOS = ("output_tok_s", "total_tok_s", "kv_token_capacity", "mean_running", "max_running")
CHECK_TAIL = 256  # check-prompt tokens past the first chunk, which attend to the chunk through the pool


def check_logprobs(llm, prompt: list[int]) -> torch.Tensor:
    """Each prompt token's logprob under the model, prefilled in --max-num-batched-tokens chunks."""
    from lamina.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])


def compare(args: argparse.Namespace, on_side=None) -> dict:
    """Runs the workload once per KV dtype; on_side(result) after each, so a caller can save what it has."""
    from lamina.args import engine_kwargs
    from lamina.bench.common import free_device, hardware
    from lamina.bench.offline import run_throughput
    from lamina.bench.workload import make_workload, parse_range
    from lamina.llm import LLM

    result = {"command": "throughput", "compare_kv_dtypes": list(DTYPES), "model": args.model,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "kv_cache_memory_gb": args.kv_cache_memory_gb, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "temperature": args.temperature}
    wl, check, logprobs = None, None, {}
    for kv in DTYPES:
        llm = LLM(**{**engine_kwargs(args), "kv_cache_dtype": kv})
        eng = llm.engine
        if wl is None:
            vocab = eng.model_config.vocab_size
            wl = make_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab)
            # Its own seed: no prefix shared with the workload's prompts (the prefix cache stays out of it).
            n = min(args.max_num_batched_tokens + CHECK_TAIL, eng.allocator.num_blocks * eng.config.block_size // 2,
                    eng.max_model_len - 1)
            check = make_workload(1, (n, n), (1, 1), vocab, seed=1).prompts[0]
            result.update(hardware=hardware(eng.device), dtype=str(eng.dtype), prompt_tokens=wl.num_prompt_tokens)
        logprobs[kv] = check_logprobs(llm, check)
        side = run_throughput(llm, wl, args.temperature)
        side["kv_storage_dtype"] = str(eng.kv_cache.views[0].k.dtype) if eng.kv_cache.views else None
        result[kv] = side
        if on_side is not None:
            on_side(result)
        device = eng.device
        del llm, eng
        free_device(device)  # the next engine sizes its pool from what is free
    diff = (logprobs["fp8"] - logprobs["auto"]).abs()
    result["check_logprobs"] = {"tokens": len(check), "max_abs_diff": diff.max().item(),
                                "mean_abs_diff": diff.mean().item(), "finite": bool(logprobs["fp8"].isfinite().all())}
    result["ratio_fp8"] = {k: result["fp8"][k] / result["auto"][k] if result["auto"][k] else None for k in RATIOS}
    return result


def table(result: dict) -> str:
    """The two runs side by side and their ratio, one row per figure."""
    rows = [("out tok/s", "output_tok_s", "{:.0f}"), ("total tok/s", "total_tok_s", "{:.0f}"),
            ("KV pool tokens", "kv_token_capacity", "{:d}"), ("mean running", "mean_running", "{:.1f}"),
            ("max running", "max_running", "{:d}"), ("preemptions", "num_preemptions", "{:d}"),
            ("elapsed s", "elapsed_s", "{:.2f}")]
    auto = result["auto"]["kv_storage_dtype"] or "auto"
    lines = [f"{'':16}{auto.removeprefix('torch.') + ' KV':>14}{'fp8 KV':>14}{'fp8/auto':>10}"]
    for name, key, fmt in rows:
        a, b = result["auto"][key], result["fp8"][key]
        ratio = f"{b / a:.2f}x" if a else "-"
        lines.append(f"{name:16}{fmt.format(a):>14}{fmt.format(b):>14}{ratio:>10}")
    c = result["check_logprobs"]
    lines.append(f"check prompt ({c['tokens']} tokens) logprobs fp8 vs auto: max |diff| {c['max_abs_diff']:.4f}, "
                 f"mean {c['mean_abs_diff']:.5f}")
    return "\n".join(lines)


def cmd_kv_compare(args: argparse.Namespace) -> int:
    from lamina.bench.common import report

    if args.baseline != "none" or args.speculative_config is not None:
        raise SystemExit("--compare-kv-dtypes runs lamina only: leave out --baseline and --speculative-config")
    if args.kv_cache_memory_gb is None:
        print("note: without --kv-cache-memory-gb each pool takes what memory is free; the capacities then "
              "compare pools of different sizes")
    result = compare(args, lambda partial: report(partial, args.result_file, show=False))
    report(result, args.result_file)
    print(table(result))
    return 0
