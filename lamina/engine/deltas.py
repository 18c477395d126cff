"""Cumulative RequestOutputs <-> per-step deltas, the two ends of the core's output channel.

The engine reports each request's whole output so far on every step; sending that would make a step's
message grow with every request's length (O(n^2) bytes over a request's life). DeltaEncoder, in the core,
keeps what it has sent of each request and emits only what is new; OutputAssembler, in the client, rebuilds
the cumulative RequestOutput (token ids and logprobs; its text is made by output_processor.py). Both drop a
request's state when it finishes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lamina.engine.ipc import CompletionDelta, OutputDelta
from lamina.outputs import CompletionOutput, RequestOutput


@dataclass
class _SentSample:
    num_tokens: int = 0
    num_logprobs: int = 0


class DeltaEncoder:
    """Core side. Not thread-safe (the core loop owns it)."""

    def __init__(self) -> None:
        self._sent: dict[str, list[_SentSample]] = {}

    def encode(self, out: RequestOutput) -> OutputDelta:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, [])
        comps = []
        for c in out.outputs:
            while len(sent) <= c.index:
                sent.append(_SentSample())
            s = sent[c.index]
            lps = None
            if c.logprobs is not None:
                lps = c.logprobs[s.num_logprobs:]
                s.num_logprobs = len(c.logprobs)
            comps.append(CompletionDelta(c.index, c.token_ids[s.num_tokens:], lps, c.cumulative_logprob,
                                         c.finish_reason, c.stop_reason))
            s.num_tokens = len(c.token_ids)
        if out.finished:
            del self._sent[out.request_id]
        return OutputDelta(out.request_id, out.finished, comps,
                           list(out.prompt_token_ids) if first else None,
                           out.prompt_logprobs if first else None,
                           out.num_cached_tokens, out.error, dict(out.metrics))

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


@dataclass
class _Assembly:
    prompt: str | None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None
    samples: dict[int, CompletionOutput] = field(default_factory=dict)


class OutputAssembler:
    """Client side. Every RequestOutput it returns is new and never mutated afterwards (its lists are fresh
    copies), so a consumer on another thread can read it while the next one is being built."""

    def __init__(self) -> None:
        self._reqs: dict[str, _Assembly] = {}

    def start(self, request_id: str, prompt: str | None) -> None:
        self._reqs[request_id] = _Assembly(prompt)

    def forget(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def clear(self) -> None:
        self._reqs.clear()

    def apply(self, d: OutputDelta) -> RequestOutput | None:
        """The request's cumulative output after this delta; None for a request this client does not know."""
        a = self._reqs.get(d.request_id)
        if a is None:
            return None
        if d.prompt_token_ids is not None:
            a.prompt_token_ids = d.prompt_token_ids
            a.prompt_logprobs = d.prompt_logprobs
        for c in d.completions:
            old = a.samples.get(c.index)
            if old is None:
                old = CompletionOutput(c.index, "", [], None, None if c.logprobs is None else [])
            lps = old.logprobs
            if c.logprobs is not None:
                lps = (lps or []) + c.logprobs
            a.samples[c.index] = CompletionOutput(c.index, "", old.token_ids + c.token_ids, c.cumulative_logprob,
                                                  lps, c.finish_reason, c.stop_reason)
        if d.finished:
            del self._reqs[d.request_id]
        outs = [a.samples[i] for i in sorted(a.samples)]
        return RequestOutput(d.request_id, a.prompt, a.prompt_token_ids, outs, d.finished, a.prompt_logprobs,
                             d.num_cached_tokens, d.error, d.metrics)
