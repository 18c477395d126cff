"""Command-line arguments shared by `lamina generate | chat | serve | bench`: the engine's settings, the
sampling settings and their defaults, and argument types that refuse bad values with one line.

Kept light (no torch, no model code) so the command line answers at once; every command module imports
from here, and this imports none of them.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from lamina.generation_config import SOURCES_HELP
from lamina.models.builtin import DEFAULT_MODEL
from lamina.spec.config import SpeculativeConfig, parse_speculative_config

QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")
DTYPES = ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32", "half", "float")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where the help text already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return super()._get_help_string(action)


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line plus a pointer to --help (not the whole usage), exit 2,
    and whose help shows each option's default (sub-command parsers inherit both)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if (action.help is None and action.option_strings and action.default is not None
                and action.default is not False and action.default != argparse.SUPPRESS):
            action.help = "(default: %(default)s)"  # an option without a help text still shows its default
        return action

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")
        sys.exit(2)


def number_type(kind: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = number_type(int, lambda v: v >= 1, "an integer >= 1")
nonnegative_int = number_type(int, lambda v: v >= 0, "an integer >= 0")
port_number = number_type(int, lambda v: 0 <= v <= 65535, "a port number in 0..65535 (0: any free port)")
positive_float = number_type(float, lambda v: v > 0 and v != float("inf"), "a number > 0")
fraction = number_type(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
power_of_two = number_type(int, lambda v: v >= 1 and not v & (v - 1), "a power of two")
nonnegative_float = number_type(float, lambda v: 0 <= v < float("inf"), "a number >= 0")


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    model_help = f"HF model directory, .gguf file, built-in name or random:<preset> (default: {DEFAULT_MODEL})"
    if positional_model:
        p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=model_help)
    else:
        p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer directory (default: the model's)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts and outputs are token ids only (default: off)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, metavar="DTYPE",
                   help="weights and activations: auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32 "
                        "(default: auto)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + output (default: the model's, capped by the KV pool)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256, help="most sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="token budget of one step")
    p.add_argument("--block-size", type=power_of_two, default=16, help="tokens per KV block")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, help="share of GPU memory to use")
    p.add_argument("--kv-cache-memory-gb", type=positive_float, default=None,
                   help="KV pool size in GiB (default: on CPU 2 GiB, on GPU what is left)")
    p.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs (default: off)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached KV blocks of shared prompt prefixes (default: on)")
    p.add_argument("--num-state-snapshots", type=nonnegative_int, default=None,
                   help="hybrid models: recurrent-state snapshots kept for prefix caching (default: 2 x max-num-seqs, "
                        "at most 10%% of GPU memory)")
    p.add_argument("--state-snapshot-interval", type=positive_int, default=256,
                   help="hybrid models: tokens between state snapshots (a multiple of block-size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the unseeded-request generator")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run dummy requests at start-up so the first ones pay no kernel compilation "
                        "(default: on with CUDA)")
    p.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                        "(methods: ngram with prompt_lookup_min/max, self_spec with skip_layers; default: off)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="quantize a dense checkpoint's weights as they load: fp8 (e4m3, one scale per output row; "
                        "decoder projections and experts, not lm_head). A quantized checkpoint always uses its "
                        "own format (default: none)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV pool entries: auto (the model dtype) or fp8 (e4m3, half the bytes of bf16: twice the "
                        "tokens) (default: auto)")
    p.add_argument("--dequantize-gguf", action="store_true",
                   help="GGUF: dequantize every tensor at load instead of keeping Q4/Q5/Q6/Q8 blocks packed")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="split the model over this many processes, one per GPU (dense attention + MLP "
                        "families; default: 1)")
    p.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="how tensor-parallel workers start: mp (processes on this host) or ray (actors of the Ray "
                        "cluster this host joined with `ray start`, across nodes; needs the ray extra) "
                        "(default: mp)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size N: place whole MoE experts across the N ranks (E/N each) "
                        "instead of splitting every expert; ignored for models without experts")
    p.set_defaults(loads_model=True)


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config JSON, checked at once (one line on a bad one)."""
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("speculative_config: ")) from None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                kv_cache_memory_gb=args.kv_cache_memory_gb, enforce_eager=args.enforce_eager, seed=args.seed,
                enable_prefix_caching=args.enable_prefix_caching, num_state_snapshots=args.num_state_snapshots,
                state_snapshot_interval=args.state_snapshot_interval, warmup=args.warmup,
                quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                speculative_config=getattr(args, "speculative_config", None),
                dequantize_gguf=getattr(args, "dequantize_gguf", False), tokenizer=getattr(args, "tokenizer", None),
                skip_tokenizer_init=getattr(args, "skip_tokenizer_init", False),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                distributed_executor_backend=getattr(args, "distributed_executor_backend", "mp"),
                enable_expert_parallel=getattr(args, "enable_expert_parallel", False))


def check_engine_args(args: argparse.Namespace) -> str | None:
    """A one-line complaint about engine settings that are each valid but do not fit together, or None."""
    if args.state_snapshot_interval % args.block_size:
        return (f"--state-snapshot-interval {args.state_snapshot_interval} must be a multiple of --block-size "
                f"{args.block_size}")
    return None


def add_generation_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help=f"where the sampling defaults come from: {SOURCES_HELP} (default: auto)")


# Sampling settings a command line can give, with the argparse names of their flags.
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def add_sampling_args(p: argparse.ArgumentParser, fallback: dict[str, Any]) -> None:
    """Sampling flags; each unset one comes from the model's generation config, else from `fallback`."""
    def default(name: str) -> str:
        return f"(default: the model's generation config, else {fallback[name]})"

    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help=f"most tokens to generate {default('max_tokens')}")
    p.add_argument("--temperature", type=nonnegative_float, default=None,
                   help=f"0 (or below 1e-5) = greedy {default('temperature')}")
    p.add_argument("--top-p", type=fraction, default=None, help=f"nucleus sampling mass {default('top_p')}")
    p.add_argument("--top-k", type=int, default=None, help=f"0 or -1 = off {default('top_k')}")
    p.add_argument("--min-p", type=number_type(float, lambda v: 0 <= v <= 1, "a number in [0, 1]"), default=None,
                   help=f"drop tokens below min-p x the top probability {default('min_p')}")
    p.add_argument("--repetition-penalty", type=positive_float, default=None,
                   help=f"> 1 discourages repeating tokens {default('repetition_penalty')}")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (default: unseeded)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    add_generation_config_arg(p)
    p.set_defaults(sampling_fallback=fallback)


def sampling_params(args: argparse.Namespace, model_defaults: dict[str, Any] | None = None):
    """SamplingParams from the flags, the model's defaults and the command's fallback, in that order."""
    from lamina.generation_config import resolve
    from lamina.sampling_params import SamplingParams

    explicit = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    values = resolve(explicit, model_defaults or {}, args.sampling_fallback)
    return SamplingParams(**values, seed=args.sampling_seed, stop=args.stop)
