"""`lamina verify MODEL`: does lamina compute what HF transformers computes for this checkpoint?

Both load the checkpoint (an HF directory or a GGUF file; HF reads a GGUF through its gguf_file loader).
lamina runs each prompt (built-in ones, or one per line of --prompts FILE) with prompt logprobs and
--max-tokens greedy tokens; HF (fp32, eager attention: the oracle) then scores the same token ids in one
forward. For every position, prompt and generated, |delta logprob| is the difference between the two
log-probabilities of that position's token; the greedy agreement length is how many of lamina's greedy
tokens are also HF's argmax given the same prefix. A prompt passes when the max and mean deltas are within
the tolerances of the dtype lamina ran at and the greedy tokens agree, except where HF's own top two are
closer than the max tolerance (a tie that either engine may break). Exit status 1 when a prompt fails.

lamina runs first and is released before HF loads, so only one copy of the weights is held at a time.

A GGUF is compared dequantized by default, as HF reads it: that checks lamina's reading of the file (config,
tensor names, block types) to fp32 precision. --keep-quantized runs lamina on the blocks as it serves them
(packed int4/int8 kernels, checked against the dequantized weights by their own tests); on the CPU torch's
int4 matmul computes in bf16, so that run needs bf16 tolerances (measured on SmolLM2 Q4_1: max 0.12, mean
0.02 against HF's fp32; dequantized: max 5e-6). MODEL may also be a built-in name (smollm2-135m-instruct).
"""
from __future__ import annotations

import argparse
import gc
import math
from dataclasses import dataclass
from pathlib import Path

# (max, mean) |delta logprob| allowed for lamina at each dtype against HF in fp32. fp32 differs only by
# summation order; half-precision rounding grows with depth and context, so those bounds are loose.
TOLERANCES = {"float32": (2e-3, 1e-4), "float16": (0.3, 0.03), "bfloat16": (1.0, 0.1)}
PROMPTS = [
    "Once upon a time, there was a little",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is 17 + 25?\nA:",
    "In 1905, Albert Einstein published four papers that changed physics. The first explained the "
    "photoelectric effect, the second Brownian motion, the third special relativity, and the fourth",
]


@dataclass
class PromptResult:
    prompt: str
    num_positions: int
    max_delta: float
    mean_delta: float
    agree: int  # leading greedy tokens HF agrees with
    num_greedy: int
    tie_at_split: bool  # the first disagreement is a near-tie in HF's own logprobs
    passed: bool


def add_verify_parser(sub) -> None:
    from lamina.args import HelpFormatter

    p = sub.add_parser("verify", help="compare lamina's logprobs with HF transformers' on a checkpoint",
                       formatter_class=HelpFormatter,
                       description="Loads MODEL in HF transformers and in lamina, runs prompts, prints per-prompt "
                                   "max and mean |delta logprob| and greedy agreement; exit 1 on FAIL.")
    p.add_argument("model", help="HF model directory, .gguf file or built-in name")
    p.add_argument("--prompts", type=Path, default=None,
                   help="file with one prompt per line, \\n for a newline inside one (default: built-in)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both engines run")
    p.add_argument("--dtype", default="float32", choices=tuple(TOLERANCES), help="lamina's dtype (HF: fp32)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--max-delta", type=float, default=None, help="override the dtype's max |delta| tolerance")
    p.add_argument("--mean-delta", type=float, default=None, help="override the dtype's mean |delta| tolerance")
    p.add_argument("--keep-quantized", action="store_true",
                   help="GGUF: run lamina on its quantized blocks (the serving path) instead of dequantized weights; "
                        "on the CPU use --dtype bfloat16 tolerances (torch's int4 matmul computes in bf16)")
    p.set_defaults(func=cmd_verify)


def tolerances(dtype: str, max_tol: float | None, mean_tol: float | None) -> tuple[float, float]:
    default_max, default_mean = TOLERANCES[dtype]
    return (default_max if max_tol is None else max_tol), (default_mean if mean_tol is None else mean_tol)


def read_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(PROMPTS)
    prompts = [line.rstrip("\n").replace("\\n", "\n") for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def run_lamina(model: str, prompts: list[str], device: str, dtype: str, max_tokens: int,
               dequantize_gguf: bool = True):
    """(token ids, lamina's logprob of each position's token from position 1 on, number of greedy tokens)
    per prompt."""
    from lamina import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, device=device, progress=False, enable_prefix_caching=False,
              dequantize_gguf=dequantize_gguf)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    runs = []
    for out in outs:
        ids, gen = list(out.prompt_token_ids), out.outputs[0]
        lps = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        lps += [gen.logprobs[i][t].logprob for i, t in enumerate(gen.token_ids)]
        runs.append((ids + list(gen.token_ids), lps, len(gen.token_ids)))
    del llm, outs
    gc.collect()
    return runs


def load_hf(model: str, device: str):
    import torch
    import transformers

    path = Path(model)
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    if path.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw)
    return hf.to(device).eval()


def compare(prompt: str, hf, ids: list[int], ours: list[float], num_greedy: int, device: str,
            max_tol: float, mean_tol: float) -> PromptResult:
    import torch

    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids], device=device)).logits[0].float()
    ref = logits.log_softmax(-1)[:-1].cpu()  # row i scores token i + 1
    targets = torch.tensor(ids[1:])
    ref_chosen = ref.gather(1, targets[:, None])[:, 0]
    delta = (torch.tensor(ours) - ref_chosen).abs()
    n_prompt = len(ids) - num_greedy
    greedy_rows = ref[n_prompt - 1:]
    agree = 0
    for row, tok in zip(greedy_rows, ids[n_prompt:]):
        if int(row.argmax()) != tok:
            break
        agree += 1
    tie = False
    if agree < num_greedy:
        row, tok = greedy_rows[agree], ids[n_prompt + agree]
        tie = float(row.max() - row[tok]) <= max_tol
    max_d, mean_d = float(delta.max()), float(delta.mean())
    ok = math.isfinite(max_d) and max_d <= max_tol and mean_d <= mean_tol and (agree == num_greedy or tie)
    return PromptResult(prompt, len(ours), max_d, mean_d, agree, num_greedy, tie, ok)


def verify(model: str, prompts: list[str], device: str = "cpu", dtype: str = "float32", max_tokens: int = 32,
           max_tol: float | None = None, mean_tol: float | None = None,
           keep_quantized: bool = False) -> list[PromptResult]:
    """Runs the comparison; tolerances default to TOLERANCES[dtype]. keep_quantized: a GGUF's blocks stay
    quantized in lamina (else it dequantizes them at load, as HF does)."""
    max_tol, mean_tol = tolerances(dtype, max_tol, mean_tol)
    runs = run_lamina(model, prompts, device, dtype, max_tokens, dequantize_gguf=not keep_quantized)
    hf = load_hf(model, device)
    return [compare(p, hf, ids, lps, n, device, max_tol, mean_tol) for p, (ids, lps, n) in zip(prompts, runs)]


def cmd_verify(args: argparse.Namespace) -> int:
    from lamina.preflight import UsageError

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    from lamina.models.builtin import BUILTIN

    if args.model in BUILTIN:  # the file inside its package (resolve_source says how to install a missing one)
        from lamina.models.loader import resolve_source

        try:
            args.model = str(resolve_source(args.model).path)
        except FileNotFoundError as exc:  # its package is not installed
            raise UsageError(str(exc)) from None
    path = Path(args.model)
    if not (path.is_file() and path.suffix == ".gguf") and not (path / "config.json").is_file():
        raise UsageError(f"{args.model} is neither a .gguf file nor a directory with config.json")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device here")
    prompts = read_prompts(args.prompts)
    max_tol, mean_tol = tolerances(args.dtype, args.max_delta, args.mean_delta)
    results = verify(args.model, prompts, args.device, args.dtype, args.max_tokens, max_tol, mean_tol,
                     args.keep_quantized)
    gguf = "; GGUF kept quantized" if args.keep_quantized else "; GGUF dequantized" if path.suffix == ".gguf" else ""
    print(f"lamina verify {args.model} ({args.dtype} on {args.device}{gguf}; HF transformers fp32 is the reference; "
          f"tolerance max {max_tol:g}, mean {mean_tol:g})")
    for i, r in enumerate(results, 1):
        tie = " (then a near-tie)" if r.tie_at_split else ""
        print(f"prompt {i}: {r.num_positions} positions, max |dlogprob| {r.max_delta:.3g}, "
              f"mean {r.mean_delta:.3g}, greedy agree {r.agree}/{r.num_greedy}{tie}: "
              f"{'PASS' if r.passed else 'FAIL'}  {r.prompt[:40]!r}")
    failed = sum(not r.passed for r in results)
    print(f"{'FAIL' if failed else 'PASS'}: {len(results) - failed}/{len(results)} prompts within tolerance")
    return 1 if failed else 0
