"""Command line: lamina generate | chat | serve | bench | verify.

Every mistake the command line can see before loading (arguments, the model source, the port) is reported
in one or two lines on stderr with exit status 2; so are the engine's refusals of a request (ValueError).
"""
from __future__ import annotations

import argparse
import logging
import sys

from lamina.args import CliParser, HelpFormatter, add_engine_args, add_sampling_args, engine_kwargs, sampling_params
from lamina.bench.cli import add_bench_parser
from lamina.chat_cli import add_chat_parser
from lamina.preflight import UsageError
from lamina.server.cli import add_serve_parser
from lamina.verify import add_verify_parser

log = logging.getLogger("lamina")

# `generate` is greedy unless told otherwise (reproducible output).
GENERATE_FALLBACK = dict(max_tokens=128, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
LOG_LEVELS = ("debug", "info", "warning", "error")


def check_generate(args: argparse.Namespace) -> None:
    """Reads the prompts (arguments, or stdin when it is not a terminal) and refuses empty ones."""
    if args.prompt:
        prompts = args.prompt
    elif sys.stdin.isatty():  # nothing piped in: say how to use it rather than wait silently
        sys.stderr.write(args.usage)
        raise UsageError("give prompts as arguments or one per line on stdin")
    else:
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty or not prompts:
        raise UsageError(f"prompt {empty[0] + 1} is empty" if empty else "no prompts on stdin")
    args.prompts = prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from lamina.generation_config import model_defaults
    from lamina.llm import LLM

    prompts = args.prompts
    params = sampling_params(args, model_defaults(args.model, args.generation_config))
    llm = LLM(**engine_kwargs(args))
    if args.chat_template:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        print(f"### prompt: {prompt!r}\n{out.outputs[0].text}\n[{out.outputs[0].finish_reason}, "
              f"{len(out.outputs[0].token_ids)} tokens]\n")
    return 0


def build_parser(bench_commands: bool = True) -> argparse.ArgumentParser:
    """The whole command line; bench_commands=False leaves out the bench sub-commands whose modules import
    torch (quicker start for the other commands)."""
    parser = CliParser(prog="lamina", description="lamina: an LLM inference engine", formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details (same as --log-level debug)")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="how much lamina logs to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline and print the results",
                         formatter_class=HelpFormatter)
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line from stdin)")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    add_engine_args(gen)
    add_sampling_args(gen, GENERATE_FALLBACK)
    gen.set_defaults(func=cmd_generate, precheck=check_generate, usage=gen.format_usage())

    add_chat_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub, bench_commands)
    add_verify_parser(sub)
    return parser


def setup_logging(args: argparse.Namespace) -> None:
    level = logging.DEBUG if args.verbose else getattr(logging, args.log_level.upper())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lamina").setLevel(level)


def _preflight(args: argparse.Namespace) -> None:
    """Checks that need no model: the arguments together, then the model source."""
    from lamina.args import check_engine_args
    from lamina.preflight import check_model_source

    problem = check_engine_args(args)
    if problem:
        raise UsageError(problem)
    log.info("lamina %s: loading %s", args.command, args.model)
    check_model_source(args.model)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(bench_commands="bench" in argv)
    args = parser.parse_args(argv)
    setup_logging(args)
    try:
        if getattr(args, "precheck", None) is not None:
            args.precheck(args)
        if getattr(args, "loads_model", False):
            _preflight(args)
        return args.func(args) or 0
    except UsageError as e:
        print(f"lamina {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:  # the engine's refusal of a setting or a request
        if log.isEnabledFor(logging.DEBUG):
            log.exception("failed")
        print(f"lamina {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
