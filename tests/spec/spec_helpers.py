"""Shared pieces of the speculative-decoding tests: engines, prompts the n-gram proposer can hit, forced
proposers (every draft right, every draft wrong) and the lease counts every scenario must end with."""
from __future__ import annotations

import random

from lamina import LLM, SamplingParams
from lamina.spec.config import parse_speculative_config
from lamina.spec.decoder import SpecDecoder

GREEDY64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "progress": False, "num_kv_blocks": 512, **kw}
    return LLM(model=str(path), **kw)


def spec_prompts(n: int, seed: int = 0) -> list[dict]:
    """Token-id prompts of mixed lengths, half of them repeating a phrase (so n-gram lookup finds drafts)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            phrase = [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 8))]
            ids = phrase * rng.randrange(2, 5) + phrase[:2]
        else:
            ids = [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))]
        out.append({"prompt_token_ids": ids})
    return out


def all_free(llm: LLM) -> bool:
    eng = llm.engine
    return (eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running
            and not eng.scheduler.waiting and not eng.groups)


class OracleProposer:
    """Proposes the reference continuation (every draft right), or with `wrong` every draft off by one."""

    def __init__(self, prompts: list[dict], outputs: list[list[int]], wrong: bool = False) -> None:
        self.ref = {tuple(p["prompt_token_ids"]): out for p, out in zip(prompts, outputs)}
        self.wrong = wrong
        self.calls = 0

    def propose(self, seqs, k):
        self.calls += 1
        drafts = []
        for s in seqs:
            ref = self.ref[tuple(s.prompt_token_ids)]
            guess = list(ref[s.num_output_tokens:s.num_output_tokens + k])
            drafts.append([(t + 1) % 1000 + 100 for t in guess] if self.wrong else guess)
        return drafts


def with_proposer(llm: LLM, proposer, k: int, min_acceptance_rate: float = 0.0) -> LLM:
    """Installs a forced proposer; drafting is never paused for low acceptance unless asked (these tests count
    every verify step of drafts forced wrong)."""
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": k,
                                    "min_acceptance_rate": min_acceptance_rate})
    llm.engine.spec = SpecDecoder(cfg, proposer)
    return llm


def outputs(llm: LLM, prompts: list[dict], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
