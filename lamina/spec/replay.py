"""The bench-only `replay` proposer: speculative-decoding mechanics at a set acceptance, where real acceptance
means nothing (random weights) or should be held fixed.

It drafts each sequence's reference continuation (the target's own greedy output, recorded by a plain run of
the same prompt) with every draft token right with probability p, else a deliberately wrong token (the
reference token + 1), so a verify run stands up to its first wrong draft: the accepted length of a run of K
drafts is min(K, geometric), E[accepted drafts] = p + p^2 + ... + p^K. Which drafts are right is a function of
(seed, prompt, absolute output position) alone, so it does not depend on batching, scheduling or how many
drafts an earlier step proposed. Drafts stop at the end of the reference.

The reference is only right while the run follows it: a sequence whose output leaves the reference (a greedy
near-tie resolved differently by a verify step's numerics) gets drafts that are almost always wrong after
that point; `lamina bench` reports how many outputs left the plain run's.
"""
from __future__ import annotations

import random
import zlib

from lamina.engine.request import Sequence


def expected_accepted_per_position(p: float, k: int) -> list[float]:
    """P(the j-th draft of a run stands) = p^(j+1), for j < k."""
    return [p ** (j + 1) for j in range(k)]


class ReplayProposer:
    def __init__(self, acceptance_prob: float, vocab: int, seed: int = 0,
                 reference: dict[tuple[int, ...], list[int]] | None = None) -> None:
        """reference: prompt token ids -> the continuation to replay (set or filled later by the bench)."""
        self.p, self.vocab, self.seed = acceptance_prob, vocab, seed
        self.reference: dict[tuple[int, ...], list[int]] = reference if reference is not None else {}

    def right(self, prompt_key: int, position: int) -> bool:
        """Whether the draft for output position `position` of the prompt hashed `prompt_key` is right."""
        if self.p >= 1.0:
            return True
        return random.Random(f"{self.seed}:{prompt_key}:{position}").random() < self.p

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        out = []
        for s in seqs:
            prompt = tuple(s.prompt_token_ids)
            ref = self.reference.get(prompt, [])
            n = s.num_output_tokens
            key = zlib.crc32(repr(prompt).encode())
            drafts = [t if self.right(key, n + j) else (t + 1) % self.vocab for j, t in enumerate(ref[n:n + k])]
            out.append(drafts)
        return out
