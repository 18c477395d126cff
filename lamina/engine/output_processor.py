"""The output side of the engine: token ids in, text out. Runs where the outputs are consumed (the API
server process's core client, or offline LLM's loop), never on the core's step loop.

Per request it keeps each sample's incremental detokenizer state and does what needs text: decodes the new
tokens, fills the `decoded_token` of logprob entries (the core leaves them None), finds stop strings in the
new text's tail, holds back text that could still become a stop string while the sample runs, and cuts a
sample at a stop string (honouring include_stop_str_in_output). A sample cut here is final from then on:
it ends with finish_reason "stop", its token ids and logprobs end at the token that completed the stop
string, and a `SampleStop` tells the core to finish it and free its blocks; tokens the core produced
after the stop are never shown. A request is finished towards its consumer once all its samples are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lamina.engine.detokenizer import _CONTEXT, Detokenizer
from lamina.engine.ipc import SampleStop
from lamina.engine.request import DetokState
from lamina.engine.stop import find_stop, held_back
from lamina.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from lamina.sampling_params import SamplingParams


@dataclass
class _Sample:
    ids: list[int]  # the prompt's last tokens (left context for the first word) + the output tokens seen
    state: DetokState
    num_tokens: int = 0  # output tokens decoded so far
    final: CompletionOutput | None = None  # set once the sample has ended here: later outputs are ignored


@dataclass
class _Request:
    params: SamplingParams
    context: list[int] | None = None  # set from the first output (which carries the prompt ids)
    samples: dict[int, _Sample] = field(default_factory=dict)


class OutputProcessor:
    """Not thread-safe: one owner thread (the core client's receiver, or the LLM loop) calls it."""

    def __init__(self, tokenizer) -> None:
        self.detok = Detokenizer(tokenizer)
        self._reqs: dict[str, _Request] = {}
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary
        # Output tokens handed to consumers, a running total: tokens the core made after a stop string cut
        # its sample are not among them (the generation-token metric counts these).
        self.num_emitted = 0

    def add(self, request_id: str, params: SamplingParams) -> None:
        self._reqs[request_id] = _Request(params)

    def forget(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def clear(self) -> None:
        self._reqs.clear()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def process(self, out: RequestOutput) -> tuple[RequestOutput | None, list[SampleStop]]:
        """The consumer's view of the core's cumulative output `out` (text filled in, stop strings applied),
        and the samples the core must now finish. None for a request not (or no longer) known here; once a
        returned output is finished the request is forgotten."""
        r = self._reqs.get(out.request_id)
        if r is None:
            return None, []
        if r.context is None:
            r.context = list(out.prompt_token_ids[-_CONTEXT:])
            if out.prompt_logprobs is not None:
                for entry in out.prompt_logprobs:
                    if entry is not None:
                        self._fill_texts(entry)
        stops: list[SampleStop] = []
        comps = []
        for c in out.outputs:
            s = r.samples.get(c.index)
            if s is None:
                s = r.samples[c.index] = _Sample(list(r.context), DetokState(0, len(r.context)))
            if s.final is not None:
                comps.append(s.final)
                continue
            seen = s.num_tokens
            comps.append(self._advance(out.request_id, r.params, s, c, stops))
            self.num_emitted += s.num_tokens - seen
        finished = out.finished or (len(comps) >= r.params.n and all(c.finish_reason is not None for c in comps))
        if finished:
            del self._reqs[out.request_id]
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, comps, finished, out.prompt_logprobs,
                             out.num_cached_tokens, out.error, out.metrics), stops

    def _advance(self, request_id: str, p: SamplingParams, s: _Sample, c: CompletionOutput,
                 stops: list[SampleStop]) -> CompletionOutput:
        """Decodes c's tokens past s.num_tokens; returns the sample as the consumer sees it now."""
        if c.logprobs is not None:
            for entry in c.logprobs[s.num_tokens:]:
                self._fill_texts(entry)
        new = c.token_ids[s.num_tokens:]
        done = c.finish_reason is not None
        skip = p.skip_special_tokens
        if done and s.num_tokens == 0 and not p.stop:
            s.ids += new  # a whole sample at once (offline): one decode
            self.detok.flush(s.state, s.ids, skip)
            s.num_tokens = len(c.token_ids)
        for j, token in enumerate(new if s.num_tokens < len(c.token_ids) else ()):
            s.ids.append(token)
            s.num_tokens += 1
            piece = self.detok.step(s.state, s.ids, skip)
            if done and j == len(new) - 1:
                piece += self.detok.flush(s.state, s.ids, skip)
            if p.stop and s.num_tokens >= p.min_tokens:
                hit = find_stop(s.state.text, len(piece), p.stop)
                if hit is not None:
                    return self._cut(request_id, p, s, c, hit, done, stops)
        text = s.state.text
        if done:
            s.final = CompletionOutput(c.index, text, c.token_ids, c.cumulative_logprob, c.logprobs,
                                       c.finish_reason, c.stop_reason)
            return s.final
        if p.stop:
            text = text[:len(text) - held_back(text, p.stop)]
        return CompletionOutput(c.index, text, c.token_ids, c.cumulative_logprob, c.logprobs)

    def _cut(self, request_id: str, p: SamplingParams, s: _Sample, c: CompletionOutput, hit: tuple[int, str],
             core_done: bool, stops: list[SampleStop]) -> CompletionOutput:
        idx, stop = hit
        n = s.num_tokens
        text = s.state.text[:idx + (len(stop) if p.include_stop_str_in_output else 0)]
        lps = cum = None
        if c.logprobs is not None:
            lps = c.logprobs[:n]
            cum = 0.0
            for token, entry in zip(c.token_ids, lps):
                cum += entry[token].logprob
        s.final = CompletionOutput(c.index, text, c.token_ids[:n], cum, lps, "stop", stop)
        if not core_done:  # the core is still generating this sample: it must stop and free its blocks
            stops.append(SampleStop(request_id, c.index, n, stop))
        return s.final

    def _fill_texts(self, entry: PositionLogprobs) -> None:
        for tid, lp in entry.items():
            if lp.decoded_token is None:
                text = self._token_texts.get(tid)
                if text is None:
                    text = self._token_texts[tid] = self.detok.token_text(tid)
                lp.decoded_token = text
