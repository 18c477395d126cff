"""`lamina bench throughput | latency | serve`: each lamina figure with its HF or vLLM baseline from the same run."""
from __future__ import annotations

import argparse

from lamina.args import HelpFormatter, add_engine_args, engine_kwargs, nonnegative_float, number_type, positive_int
from lamina.bench.common import free_device as _free_device
from lamina.bench.common import hardware, report
from lamina.bench.spec import add_spec_bench_args
from lamina.bench.vllm_baseline import add_vllm_args


def add_bench_parser(sub, all_commands: bool = True) -> None:
    """bench throughput | latency | save-random, and (all_commands) prefix | gdn-prefill | serve, whose
    modules import torch or httpx at load (left out when another command runs, for a quick start)."""
    bench = sub.add_parser("bench", help="benchmarks (offline throughput, latency, serving)",
                           formatter_class=HelpFormatter)
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    tp = bsub.add_parser("throughput", help="offline throughput on random token-id prompts",
                         formatter_class=HelpFormatter)
    add_engine_args(tp)
    tp.add_argument("--num-prompts", type=positive_int, default=32, help="prompts to run")
    tp.add_argument("--input-len", default="128", help="N or MIN:MAX (uniform)")
    tp.add_argument("--output-len", default="128", help="N or MIN:MAX (uniform)")
    tp.add_argument("--baseline", choices=["none", "hf", "vllm"], default="none",
                    help="also run HF transformers, or vLLM (in a child process)")
    tp.add_argument("--hf-mode", choices=["generate", "generate_batch"], default=None,
                    help="HF baseline: padded static batches, or continuous batching (default: GPU generate_batch, "
                         "CPU generate)")
    tp.add_argument("--hf-attn", default="sdpa", help="HF attn_implementation (sdpa, eager, paged|sdpa, ...)")
    tp.add_argument("--hf-batch-size", type=positive_int, default=None, help="HF generate batch size (default: all)")
    tp.add_argument("--temperature", type=nonnegative_float, default=0.0,
                    help="lamina's sampling temperature (default 0: greedy, like the HF baseline)")
    tp.add_argument("--result-file", default=None, help="also write the result JSON here")
    tp.add_argument("--compare-kv-dtypes", action="store_true",
                    help="run the workload twice in this process, KV pool in the model dtype (auto) then fp8 "
                         "(--kv-cache-dtype is ignored), and print for each out/total tok/s, the pool's token "
                         "capacity, mean and max running sequences per step, preemptions, and the fp8/auto "
                         "ratios; fix the pool with --kv-cache-memory-gb so both get the same bytes "
                         "(lamina only: no --baseline)")
    add_vllm_args(tp)
    add_spec_bench_args(tp)
    tp.set_defaults(func=cmd_throughput)

    lat = bsub.add_parser("latency", help="single-request TTFT and decode speed, with achieved bandwidth",
                          formatter_class=HelpFormatter)
    add_engine_args(lat)
    lat.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens")
    lat.add_argument("--output-len", type=number_type(int, lambda v: v >= 2, "an integer >= 2"), default=128,
                     help="tokens to generate (>= 2)")
    lat.add_argument("--repeats", type=positive_int, default=3, help="timed runs (the median is reported)")
    lat.add_argument("--baseline", choices=["none", "hf", "hf-compiled", "hf-both", "vllm"], default="none",
                     help="hf: HF generate (dynamic cache, eager); hf-compiled: static cache + torch.compile; "
                          "hf-both: both, one after the other; vllm: vLLM in a child process")
    lat.add_argument("--hf-attn", default="sdpa", help="HF attn_implementation")
    lat.add_argument("--peak-tflops", type=float, default=790.0,
                     help="matmul rate to compute MFU against (H200 bf16, measured: 790)")
    lat.add_argument("--result-file", default=None, help="also write the result JSON here")
    add_vllm_args(lat)
    add_spec_bench_args(lat)
    lat.set_defaults(func=cmd_latency)

    from lamina.bench.checkpoint import add_save_random_parser

    add_save_random_parser(bsub)
    from lamina.bench.perplexity import add_perplexity_parser

    add_perplexity_parser(bsub)
    if all_commands:
        from lamina.bench.kernels import add_kernel_bench_parser
        from lamina.bench.prefix import add_prefix_bench_parser
        from lamina.bench.serve import add_serve_bench_parser

        add_prefix_bench_parser(bsub)
        add_kernel_bench_parser(bsub)
        add_serve_bench_parser(bsub)


def cmd_throughput(args: argparse.Namespace) -> int:
    from lamina.bench import hf_baseline, vllm_baseline
    from lamina.bench.offline import run_throughput
    from lamina.bench.workload import make_workload, parse_range
    from lamina.llm import LLM

    if args.compare_kv_dtypes:  # model-dtype vs FP8 KV pool, compared (bench/kv_compare.py)
        from lamina.bench.kv_compare import cmd_kv_compare

        return cmd_kv_compare(args)
    if args.speculative_config is not None:  # with and without speculation, compared (bench/spec.py)
        from lamina.bench.spec import cmd_spec

        return cmd_spec(args, "throughput")
    if args.baseline == "vllm":
        vllm_baseline.require_vllm(args)
    llm = LLM(**engine_kwargs(args))
    eng = llm.engine
    wl = make_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len),
                       eng.model_config.vocab_size)
    result = {"command": "throughput", "model": args.model, "hardware": hardware(eng.device),
              "dtype": str(eng.dtype), "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "prompt_tokens": wl.num_prompt_tokens,
              "temperature": args.temperature, "lamina": run_throughput(llm, wl, args.temperature)}
    device, dtype = eng.device, eng.dtype
    del llm, eng
    if args.baseline == "hf":
        # lamina's figures survive a baseline that fails (e.g. out of memory); printed once, at the end
        report(result, args.result_file, show=False)
        _free_device(device)
        mode = args.hf_mode or ("generate_batch" if device.type == "cuda" else "generate")
        model = hf_baseline.load_hf(args.model, dtype, device, args.hf_attn)
        if mode == "generate":
            elapsed, out_tokens = hf_baseline.hf_generate_padded(model, wl, args.hf_batch_size or args.num_prompts,
                                                                 device)
        else:
            elapsed, out_tokens = hf_baseline.hf_generate_batch(model, wl, device), sum(wl.output_lens)
        useful = sum(wl.output_lens)  # padded batches may generate more; only requested tokens count
        result["hf"] = {"mode": mode, "attn": args.hf_attn, "elapsed_s": elapsed, "generated_tokens": out_tokens,
                        "output_tok_s": useful / elapsed, "total_tok_s": (useful + wl.num_prompt_tokens) / elapsed}
        result["ratio_output_tok_s"] = result["lamina"]["output_tok_s"] / result["hf"]["output_tok_s"]
    if args.baseline == "vllm":
        vllm_baseline.compare_throughput(result, args, wl, device, dtype)
    report(result, args.result_file)
    return 1 if vllm_baseline.failed(result) else 0


def prefill_flops(model, cfg, n: int) -> float:
    """Matmul FLOPs of a causal prefill of n tokens: 2 * active params per token (lm_head on the last row
    only), plus the attention layers' QK^T and PV. The recurrent layers' own core is left out (small)."""
    from lamina.bench.offline import active_params_per_token
    from lamina.models.config import KV_MIXERS

    lm_head = cfg.hidden_size * cfg.vocab_size
    linear = 2 * (n * (active_params_per_token(model) - lm_head) + lm_head)
    n_attn = sum(1 for spec in cfg.layers if spec.mixer in KV_MIXERS)
    attention = n_attn * 2 * 2 * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
    if cfg.mla is not None:  # MLA (expanded prefill): QK^T over nope + rope dims, PV over v_head_dim
        m = cfg.mla
        n_mla = sum(1 for spec in cfg.layers if spec.mixer == "mla")
        width = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
        attention += n_mla * 2 * cfg.num_heads * width * n * (n + 1) / 2
    return linear + attention


def cmd_latency(args: argparse.Namespace) -> int:
    from lamina.bench import hf_baseline, vllm_baseline
    from lamina.bench.offline import copy_bandwidth, run_latency, state_bytes_per_token, weight_bytes_per_token
    from lamina.bench.workload import make_workload
    from lamina.engine.build import kv_storage_dtype
    from lamina.llm import LLM

    if args.speculative_config is not None:  # with and without speculation, compared (bench/spec.py)
        from lamina.bench.spec import cmd_spec

        return cmd_spec(args, "latency")
    if args.baseline == "vllm":
        vllm_baseline.require_vllm(args)
    llm = LLM(**engine_kwargs(args))
    eng = llm.engine
    prompt = make_workload(1, (args.input_len,) * 2, (args.output_len,) * 2, eng.model_config.vocab_size).prompts[0]
    lat = run_latency(llm, prompt, args.output_len, args.repeats)
    # The roofline counts what one decode step must move: active weights plus the sequence's state/KV (at
    # the mean context of the decode phase).
    wbytes = weight_bytes_per_token(eng.model)
    sbytes = state_bytes_per_token(eng.model, args.input_len + args.output_len // 2, kv_storage_dtype(eng.config))
    bw = copy_bandwidth(eng.device)
    achieved = (wbytes + sbytes) * lat["decode_tok_s"]
    result = {"command": "latency", "model": args.model, "hardware": hardware(eng.device), "dtype": str(eng.dtype),
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "input_len": args.input_len, "output_len": args.output_len, "lamina": lat,
              "weight_bytes_per_token": wbytes, "state_bytes_per_token": sbytes,
              "measured_copy_bandwidth_GBs": bw / 1e9, "achieved_bandwidth_GBs": achieved / 1e9,
              "fraction_of_roofline": achieved / bw, "roofline_tok_s": bw / (wbytes + sbytes)}
    flops = prefill_flops(eng.model, eng.model_config, args.input_len)
    result["prefill_tflops"] = flops / lat["ttft_s"] / 1e12
    result["prefill_mfu"] = result["prefill_tflops"] / args.peak_tflops
    device, dtype = eng.device, eng.dtype
    del llm, eng
    if args.baseline in ("hf", "hf-compiled", "hf-both"):
        report(result, args.result_file, show=False)
        _free_device(device)
        model = hf_baseline.load_hf(args.model, dtype, device, args.hf_attn)
        if args.baseline in ("hf", "hf-both"):
            result["hf"] = hf_baseline.hf_latency(model, prompt, args.output_len, device)
            result["ratio_decode_tok_s"] = lat["decode_tok_s"] / result["hf"]["decode_tok_s"]
            report(result, args.result_file, show=False)
        if args.baseline in ("hf-compiled", "hf-both"):
            result["hf_compiled"] = hf_baseline.hf_latency_compiled(model, prompt, args.output_len, device)
            result["ratio_decode_tok_s_hf_compiled"] = lat["decode_tok_s"] / result["hf_compiled"]["decode_tok_s"]
    if args.baseline == "vllm":
        vllm_baseline.compare_latency(result, args, prompt, device, dtype)
    report(result, args.result_file)
    return 1 if vllm_baseline.failed(result) else 0
