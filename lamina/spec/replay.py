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

Forced acceptance (`"forced": true`) takes numerics out of it: the verify step's accepted count is this
proposer's decision (the leading right drafts, `forced_counts`), the output follows the drafts (right or not)
and the target's token at the first wrong draft, so the device runs exactly a real verify step at acceptance p
(same K+1 rows, kernels, sampling and rollback of the rejected positions) and acceptance no longer depends on
the target agreeing. Without a reference for a prompt it still drafts K tokens (after the last token's id).
"""
from __future__ import annotations

import hashlib
import zlib

from lamina.engine.request import Sequence


def expected_accepted_per_position(p: float, k: int) -> list[float]:
    """P(the j-th draft of a run stands) = p^(j+1), for j < k."""
    return [p ** (j + 1) for j in range(k)]


class ReplayProposer:
    def __init__(self, acceptance_prob: float, vocab: int, seed: int = 0,
                 reference: dict[tuple[int, ...], list[int]] | None = None, forced: bool = False) -> None:
        """reference: prompt token ids -> the continuation to replay (set or filled later by the bench).
        forced: the accepted count of each verify step is this proposer's decision (forced_counts)."""
        self.p, self.vocab, self.seed, self.forced = acceptance_prob, vocab, seed, forced
        self.reference: dict[tuple[int, ...], list[int]] = reference if reference is not None else {}
        self.decided: dict[int, int] = {}  # forced: seq_id -> leading right drafts of its last proposal
        # seq_id -> (prompt hash, reference, right[] by output position so far): each position's draw is
        # hashed once per sequence, not once per verify step that drafts it (K per step; with p = 0.8 a
        # position is drafted ~1.8 times), ~0.3 ms of a 64-sequence step's critical host path.
        self._prompts: dict[int, tuple[int, list[int], list[bool]]] = {}

    def right(self, prompt_key: int, position: int) -> bool:
        """Whether the draft for output position `position` of the prompt hashed `prompt_key` is right: a uniform
        draw from a hash of (seed, prompt, position). blake2b (2.2 us here), not random.Random(str) (17 us:
        it seeds through sha512 and a 624-word state); with the prompt hashed once per sequence (crc32 of a
        128-token prompt's repr: 30 us) the bench's drafting went from ~83 to ~8 us per sequence and verify
        step, ~5 ms of host time a step at 64 sequences that counted against speculation's tokens/s."""
        if self.p >= 1.0:
            return True
        digest = hashlib.blake2b(f"{self.seed}:{prompt_key}:{position}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2.0**64 < self.p

    def _prompt(self, seq: Sequence) -> tuple[int, list[int], list[bool]]:
        """The sequence's prompt hash, reference and the right() decisions made so far, once per sequence."""
        got = self._prompts.get(seq.seq_id)
        if got is None:
            prompt = tuple(seq.prompt_token_ids)
            key, ref = zlib.crc32(repr(prompt).encode()), self.reference.get(prompt, [])
            # every reference position decided up front (in the sequence's first step, ~2 us each), so later
            # verify steps, whose host work the device waits for, only slice
            got = self._prompts[seq.seq_id] = (key, ref, [self.right(key, j) for j in range(len(ref))])
        return got

    def _rights(self, key: int, known: list[bool], n: int, count: int) -> list[bool]:
        """right(key, n + j) for j < count, each position hashed once (known: the decisions for 0, 1, ...)."""
        if len(known) < n + count:
            known += [self.right(key, j) for j in range(len(known), n + count)]
        return known[n:n + count]

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        out = []
        self.decided = decided = {}
        live = {s.seq_id for s in seqs}
        if len(self._prompts) > 2 * len(live) + 64:  # sequences that ended or paused: hashed again if back
            self._prompts = {sid: v for sid, v in self._prompts.items() if sid in live}
        prompts, forced = self._prompts, self.forced
        for s in seqs:
            got = prompts.get(s.seq_id)
            key, ref, known = got if got is not None else self._prompt(s)
            n = s.num_output_tokens
            if n + k <= len(ref):  # the usual case: k reference positions, each decided once already
                right = known[n:n + k]
                want = ref[n:n + k]
            else:
                want = ref[n:n + k]
                if forced and len(want) < k:  # any token will do when the count is forced
                    want = want + [(s.token_ids[-1] + 1 + j) % self.vocab for j in range(len(want), k)]
                right = self._rights(key, known, n, len(want))
            out.append([t if ok else (t + 1) % self.vocab for t, ok in zip(want, right)])
            if forced:
                decided[s.seq_id] = right.index(False) if False in right else len(right)
        return out

    def forced_counts(self, sampled: list[tuple[Sequence, int, int]]) -> list[int]:
        """Forced acceptance: per sampled sequence of a step (InFlight.sampled order), its accepted count: the
        leading right drafts of its proposal, capped at the drafts the step verified (n - 1)."""
        return [min(self.decided.get(seq.seq_id, 0), n - 1) for seq, _, n in sampled]
