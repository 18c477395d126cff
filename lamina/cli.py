"""Command line: lamina generate | chat | serve | bench."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from lamina.models.loader import DEFAULT_MODEL


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    if positional_model:
        p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                       help=f"HF model directory, .gguf file or built-in name (default: {DEFAULT_MODEL})")
    else:
        p.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"HF model directory, .gguf file or built-in name (default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: model's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory to use")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV pool size (default CPU: 2 GiB)")
    p.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached KV blocks of shared prompt prefixes")
    p.add_argument("--num-state-snapshots", type=int, default=None,
                   help="hybrid models: recurrent-state snapshots kept for prefix caching (default: 2 x max-num-seqs, "
                        "at most 10%% of GPU memory)")
    p.add_argument("--state-snapshot-interval", type=int, default=256,
                   help="hybrid models: tokens between state snapshots (a multiple of block-size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the unseeded-request generator")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                kv_cache_memory_gb=args.kv_cache_memory_gb, enforce_eager=args.enforce_eager, seed=args.seed,
                enable_prefix_caching=args.enable_prefix_caching, num_state_snapshots=args.num_state_snapshots,
                state_snapshot_interval=args.state_snapshot_interval)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from lamina.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop)


def cmd_generate(args: argparse.Namespace) -> int:
    from lamina.llm import LLM

    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat_template:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        print(f"### prompt: {prompt!r}\n{out.outputs[0].text}\n[{out.outputs[0].finish_reason}, "
              f"{len(out.outputs[0].token_ids)} tokens]\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lamina", description="lamina: an LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline and print the results")
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line from stdin)")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    from lamina.chat_cli import add_chat_parser
    from lamina.bench.cli import add_bench_parser
    from lamina.server.cli import add_serve_parser

    add_chat_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
