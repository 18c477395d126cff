"""Start-up warm-up on CUDA: a few dummy requests through the real step loop, so that the first burst of
traffic does not pay Triton's JIT compilation.

Triton compiles a kernel variant the first time it meets a new specialization (a tile regime, a power-of-two
block size, divisibility of a shape). Captured graphs compile their shapes at capture, but eager steps (the
mixed prefill + decode steps of models without mixed graphs, prompt chunks of new sizes, the MoE layout of a
new pair count, the sampler's paths) compile on first use. Measured on the H200, Qwen3-Next-80B-A3B shape (24
layers), 64 x (1,024 in / 256 out): 6.99 s after a two-prompt, four-token warm-up, 6.19 s after one on the
workload's own shapes: about 0.8 s of compilation fell inside the first requests.

The requests are greedy or explicitly seeded, so no sampler state a later request sees is consumed; the
prefix cache's statistics are reset afterwards (its blocks of random token ids are ordinary free blocks).
"""
from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

from lamina.sampling_params import SamplingParams
from lamina.structured.bitmask import warm_up_bitmask

if TYPE_CHECKING:
    from lamina.engine.engine import LLMEngine

log = logging.getLogger("lamina")


def warmup_requests(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int, vocab_size: int,
                    seed: int = 0) -> list[list[tuple[list[int], SamplingParams]]]:
    """Rounds of (prompt ids, params) run one round at a time: single prompts of 16, 64, 256, ... tokens up to
    one full step (each a prompt step of that size, then a few decode steps), then one round of many short
    prompts of mixed lengths together (mixed steps with many sequences), with seeded sampling, top-k/top-p
    and logprobs rows among them."""
    rng = random.Random(seed)
    top = min(max_num_batched_tokens, max_model_len - 8)

    def ids(n: int) -> list[int]:
        return [rng.randrange(min(1000, vocab_size // 2), vocab_size) for _ in range(n)]

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rounds: list[list[tuple[list[int], SamplingParams]]] = []
    n = 16
    while n < top:
        rounds.append([(ids(n), greedy)])
        n *= 4
    if top >= 1:
        rounds.append([(ids(top), greedy)])
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=seed, max_tokens=4, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, logprobs=2, max_tokens=4, ignore_eos=True)
    many = []
    for i in range(min(max_num_seqs, 64)):
        length = max(1, min(8 + 37 * i % 300, max_model_len - 8))
        many.append((ids(length), (sampled, with_logprobs, greedy, greedy)[i % 4]))
    rounds.append(many)
    return rounds


def warm_up(engine: LLMEngine) -> int:
    """Runs the warm-up rounds to completion on the engine; returns the number of requests run. Leaves no
    request, block or slot behind (the engine's usual bookkeeping frees them)."""
    rounds = warmup_requests(engine.config.max_num_batched_tokens, engine.max_model_len, engine.config.max_num_seqs,
                             engine.model_config.vocab_size, engine.config.seed)
    stream, engine.stream_outputs = engine.stream_outputs, False
    count = 0
    try:
        for r, batch in enumerate(rounds):
            for i, (prompt, params) in enumerate(batch):
                engine.add_request(f"__warmup-{r}-{i}", prompt, params)
                count += 1
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.stream_outputs = stream
        for rid in engine.request_ids():  # only if a step raised: leave nothing queued
            engine.abort_request(rid)
    if engine.prefix_cache is not None:
        engine.prefix_cache.reset_stats()
    warm_up_bitmask(engine.runner.vocab or engine.model_config.vocab_size, engine.runner.device)
    return count
