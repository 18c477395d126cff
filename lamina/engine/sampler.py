"""Batched sampling with per-row parameters: penalties, temperature, top-k, top-p, min-p, seeds, logprobs.

Everything is tensor ops over the whole batch; the only host sync is reading the sampled tokens back.
A seeded row's draws come from a counter-based hash of (seed, output index, vocab index), not from a
stateful generator, so its output does not depend on what else shares the batch, and a preempted
sequence that is recomputed draws the same tokens again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.engine.request import Sequence

_MIX = 0x9E3779B97F4A7C15


@dataclass
class SamplerOutput:
    token_ids: list[int]
    chosen_logprobs: list[float] | None  # logprob of each sampled token (raw model distribution)
    chosen_ranks: list[int] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


def _row_key(seed: int, step: int) -> int:
    """A 32-bit key from (seed, step): splitmix64-style, on Python ints (exact, no overflow)."""
    x = (seed * _MIX + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return (x ^ (x >> 31)) & 0xFFFF_FFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # int64 lanes holding 32-bit values; the multiplier is < 2^27 so products never overflow int64.
    for _ in range(2):
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & 0xFFFF_FFFF
    return x ^ (x >> 16)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [R, vocab], a pure function of each row's key and the token index."""
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = _mix32(((idx[None] * 0x9E3779B1) & 0xFFFF_FFFF) ^ keys[:, None])
    u = (x.float() + 0.5) * (1.0 / 4294967296.0)
    return -torch.log(u)


def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition (HF: prompt + output), presence and frequency (OpenAI: output only) penalties, in place."""
    dev, v = logits.device, logits.shape[1]
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(seq.token_ids)), device=dev, dtype=torch.long)
            vals = logits[row, ids]
            logits[row, ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            out = torch.tensor(seq.output_token_ids, device=dev, dtype=torch.long)
            counts = torch.zeros(v, device=dev).scatter_add_(0, out, torch.ones_like(out, dtype=torch.float))
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _ban_stops_below_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos: list[int]) -> None:
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else eos)
            if banned:
                logits[row, banned] = float("-inf")


def _filter(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Masks tokens outside top-k / top-p / min-p with -inf (rows where a filter is off are untouched)."""
    v, dev = logits.shape[1], logits.device
    params = [s.params for s in seqs]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).clamp(max=v)
        ranks = torch.arange(v, device=logits.device)[None]
        drop = ranks >= k[:, None]
        probs = sorted_logits.softmax(dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop |= cum_before > top_p[:, None]  # keeps the smallest set reaching top_p (at least one token)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int = 0) -> None:
        self.eos = eos_token_ids
        self.seed = seed
        self._gens: dict[torch.device, torch.Generator] = {}

    def _noise(self, seqs: list[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
        """Exp(1) noise; argmax(probs / noise) is a draw from probs (the exponential race). Unseeded rows
        draw from the engine's generator (cheapest); seeded rows from the hash of (seed, output index)."""
        if device not in self._gens:
            self._gens[device] = torch.Generator(device=device).manual_seed(self.seed)
        noise = torch.empty(len(seqs), vocab, device=device).exponential_(generator=self._gens[device])
        seeded = [i for i, s in enumerate(seqs) if s.seed is not None]
        if seeded:
            keys = torch.tensor([_row_key(seqs[i].seed, seqs[i].num_output_tokens) for i in seeded],
                                dtype=torch.int64, device=device)
            rows = torch.tensor(seeded, device=device)
            noise.index_copy_(0, rows, exponential_noise(keys, vocab))
        return noise

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleTensors:
        """Draws one token per row; everything stays on the device (no host sync)."""
        logits = logits.float()
        dev = logits.device
        num_lp = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
        raw_logprobs = logits.log_softmax(dim=-1) if num_lp is not None else None
        if any(needs_history(s) for s in seqs):
            logits = logits.clone()  # penalties edit in place; the caller's logits stay raw
            _penalize(logits, seqs)
            _ban_stops_below_min_tokens(logits, seqs, self.eos)

        tokens = logits.argmax(dim=-1)
        if not all(s.params.greedy for s in seqs):
            temps = torch.tensor([s.params.temperature or 1.0 for s in seqs], device=dev)
            greedy = torch.tensor([s.params.greedy for s in seqs], device=dev)
            probs = _filter(logits / temps[:, None], seqs).softmax(dim=-1)
            sampled = (probs / self._noise(seqs, probs.shape[1], dev)).argmax(dim=-1)
            tokens = torch.where(greedy, tokens, sampled)
        out = SampleTensors(tokens)
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens[:, None])
            out.chosen_logprobs = chosen[:, 0]
            out.chosen_ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
            if num_lp > 0:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(num_lp, dim=-1)
        return out

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        return self.sample(logits, seqs).to_host()


def needs_history(seq: Sequence) -> bool:
    """Whether sampling this row reads the sequence's earlier tokens (so they must be known on the host)."""
    p = seq.params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or seq.num_output_tokens < p.min_tokens)


@dataclass
class SampleTensors:
    """A step's draws, still on the device; to_host() is the one sync point."""

    token_ids: torch.Tensor
    chosen_logprobs: torch.Tensor | None = None
    chosen_ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def _fields(self) -> list[torch.Tensor | None]:
        return [self.token_ids, self.chosen_logprobs, self.chosen_ranks, self.top_ids, self.top_logprobs]

    def start_copy(self):
        """Starts copying the draws to the host without waiting; finish_copy() waits for that copy only."""
        if self.token_ids.device.type != "cuda":
            return None
        host = [None if t is None else t.to("cpu", non_blocking=True) for t in self._fields()]
        event = torch.cuda.Event()
        event.record()
        return host, event

    def finish_copy(self, started) -> SamplerOutput:
        if started is None:
            return self.to_host()
        host, event = started
        event.synchronize()
        return SamplerOutput(*[None if t is None else t.tolist() for t in host])

    def to_host(self) -> SamplerOutput:
        return SamplerOutput(*[None if t is None else t.tolist() for t in self._fields()])
