"""Benchmark workloads: random token-id prompts with lengths drawn from ranges (same seed, same prompts)."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def parse_range(text: str) -> tuple[int, int]:
    """"512" -> (512, 512); "100:1024" -> (100, 1024)."""
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if lo_i < 1 or hi_i < lo_i:
        raise ValueError(f"bad length range {text!r}")
    return lo_i, hi_i


def make_workload(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                  seed: int = 0) -> Workload:
    rng = random.Random(seed)
    # Skip the lowest ids, where tokenizers keep special tokens.
    prompts = [[rng.randrange(1000, vocab_size) for _ in range(rng.randint(*input_len))] for _ in range(num)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num)])
