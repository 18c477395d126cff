"""EngineCore: one LLMEngine behind the operations the core loop and offline LLM share.

Adds answer with a verdict (the engine's ValueError, nothing queued) or go in; aborts return the aborted
requests' final outputs; stop_samples ends samples at the stop strings the output side found; a step that
raises fails the requests in flight and returns their leases, so the core keeps serving; every step also
yields its IterationStats (token counts and latencies for /metrics). The core makes no text: outputs carry
token ids and logprobs, and output_processor.py (in the server process, or offline LLM's loop) decodes.
Timing is taken here, next to the engine, so the metrics do not include IPC or the server's event loop.

Single-threaded: whoever owns the core (the core process's loop, a test thread, LLM) calls it from one thread.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from lamina.engine.engine import EngineStats, LLMEngine
from lamina.engine.ipc import FinishedRequest, IterationStats, SampleStop
from lamina.outputs import RequestOutput
from lamina.parallel.context import ParallelFailure
from lamina.sampling_params import SamplingParams

log = logging.getLogger("lamina")


@dataclass
class _Tracker:
    """Per-request timing for the latency metrics."""
    arrival: float
    first_token: bool = False
    num_tokens: dict[int, int] = field(default_factory=dict)  # sample index -> tokens seen
    last_token_time: dict[int, float] = field(default_factory=dict)


class EngineCore:
    def __init__(self, engine: LLMEngine, stream_outputs: bool = True) -> None:
        self.engine = engine
        # Streaming callers (the server) want every step's progress; offline batches only finished requests.
        engine.stream_outputs = stream_outputs
        self._trackers: dict[str, _Tracker] = {}
        self.num_step_failures = 0

    def add(self, request_id: str, prompt: Any, params: SamplingParams | dict[str, Any]) -> None:
        """Queues a request; raises ValueError (and changes nothing) on bad input."""
        if isinstance(params, dict):
            try:
                params = SamplingParams(**params)
            except TypeError as e:  # an unknown field
                raise ValueError(f"bad sampling parameters: {e}") from None
        self.engine.add_request(request_id, prompt, params)
        self._trackers[request_id] = _Tracker(time.monotonic())

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Final outputs (finish_reason 'abort') of those still running; unknown ids are ignored."""
        outs = []
        for rid in request_ids:
            self._trackers.pop(rid, None)
            out = self.engine.abort_request(rid)
            if out is not None:
                outs.append(out)
        return outs

    def stop_samples(self, items: list[SampleStop], it: IterationStats) -> list[RequestOutput]:
        """Ends samples at the stop strings the output side found (their blocks are freed now); returns the
        outputs of the requests they belong to. Samples that had already ended are left as they were."""
        outs = []
        now = time.monotonic()
        for item in items:
            out = self.engine.finish_sample(item.request_id, item.index, item.num_tokens, item.stop)
            if out is not None:
                self._track(out, now, it)  # a request finished this way counts as finished with "stop"
                outs.append(out)
        return outs

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def step(self, it: IterationStats, contain_failures: bool = True) -> list[RequestOutput]:
        """One engine step. With contain_failures, an exception fails every request in flight (outputs with
        `error` set) instead of propagating."""
        try:
            outputs = self.engine.step()
            it.num_step_tokens += self.engine.scheduler.num_scheduled_tokens
        except Exception as exc:
            if not contain_failures or isinstance(exc, ParallelFailure):  # a lost TP worker: the core has failed
                raise
            log.exception("engine step failed; failing the requests in flight")
            self.num_step_failures += 1
            it.step_failed = True
            return self.fail_all(f"{type(exc).__name__}: {exc}")
        now = time.monotonic()
        for out in outputs:
            self._track(out, now, it)
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Ends every request in flight with `message` as its error and returns their leases, so the engine
        starts over clean."""
        outs = []
        for rid in self.engine.request_ids():
            try:
                out = self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
                continue
            if out is not None:
                out.error = message
                out.finished = True
                outs.append(out)
        self._trackers.clear()
        return outs

    def _track(self, out: RequestOutput, now: float, it: IterationStats) -> None:
        tr = self._trackers.get(out.request_id)
        if tr is None:
            return
        for comp in out.outputs:
            n = len(comp.token_ids)
            prev = tr.num_tokens.get(comp.index, 0)
            if n > prev:
                it.num_generation_tokens += n - prev
                if not tr.first_token:
                    tr.first_token = True
                    it.num_prompt_tokens += len(out.prompt_token_ids)
                    it.num_cached_prompt_tokens += out.num_cached_tokens
                    it.time_to_first_tokens.append(now - tr.arrival)
                elif comp.index in tr.last_token_time:
                    gap = (now - tr.last_token_time[comp.index]) / (n - prev)
                    it.inter_token_latencies += [gap] * (n - prev)
                tr.num_tokens[comp.index] = n
                tr.last_token_time[comp.index] = now
        if out.finished:
            del self._trackers[out.request_id]
            it.finished.append(finished_request(out, now, tr.arrival))


def finished_request(out: RequestOutput, now: float, arrival: float) -> FinishedRequest:
    """A finished request's numbers; the phases come from the engine's own (monotonic) timestamps."""
    m = out.metrics
    arrived, scheduled, first = m.get("arrival_time", arrival), m.get("first_scheduled_time"), m.get("first_token_time")
    return FinishedRequest(out.outputs[0].finish_reason or "stop", now - arrival, len(out.prompt_token_ids),
                           sum(len(c.token_ids) for c in out.outputs),
                           queue_time=None if scheduled is None else max(scheduled - arrived, 0.0),
                           prefill_time=None if scheduled is None or first is None else max(first - scheduled, 0.0),
                           decode_time=None if first is None else max(now - first, 0.0),
                           inference_time=None if scheduled is None else max(now - scheduled, 0.0),
                           num_preemptions=int(m.get("num_preemptions", 0)))
