"""The messages between the API server process and the engine core, and how they travel (ZeroMQ + msgpack).

Two one-way PUSH/PULL channels over ipc:// sockets: the client sends `Add`, `Abort`, `StopSamples` and
`Shutdown` to the core; the core sends `Ready` once, then `Verdicts` (one per drained batch of adds),
`StepOutputs` (one per iteration: every request's progress in that step, plus the iteration's metrics and
the engine's stats) and, if its loop dies, `CoreFailed`. Outputs are deltas (new token ids and logprobs; no
text, which the client side makes): the client keeps the cumulative RequestOutput, so a message's size does
not grow with how long a request has run.

Each message is one frame, a msgpack map tagged with its type; the channel is in order, which is what lets an
abort sent after an add undo it.
"""
from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from lamina.engine.engine import EngineStats
from lamina.outputs import Logprob


# ---- metrics of one iteration (computed in the core, fed to Prometheus in the server) ------------------------
@dataclass
class FinishedRequest:
    finish_reason: str  # of the first sample: "stop", "length" or "error" (aborts are not counted)
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # Phases (seconds; None when the request never got that far) and preemptions, as vLLM reports them.
    queue_time: float | None = None  # arrival -> first scheduled
    prefill_time: float | None = None  # first scheduled -> first token
    decode_time: float | None = None  # first token -> finish
    inference_time: float | None = None  # first scheduled -> finish
    num_preemptions: int = 0


@dataclass
class IterationStats:
    """What one engine iteration did, in the units Prometheus wants."""
    num_prompt_tokens: int = 0  # prompts that got their first token this iteration
    num_cached_prompt_tokens: int = 0  # of those, tokens served from the prefix cache
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    step_failed: bool = False  # engine.step() raised and the requests in flight were failed
    num_added: int = 0  # requests admitted into the engine just before this iteration's step
    num_step_tokens: int = 0  # tokens the step scheduled (prefill chunks, decodes, drafts)


# ---- client -> core -------------------------------------------------------------------------------------------
class Add(msgspec.Struct, tag=True):
    """A request. `params` are SamplingParams' fields: the core rebuilds (and so validates) them, and a bad
    value becomes this add's verdict instead of a decode error for the whole channel."""
    request_id: str
    prompt: Any  # a string or a list of token ids (validated by the engine)
    params: dict[str, Any]


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class SampleStop(msgspec.Struct, array_like=True):
    """The output side found a stop string: sample `index` of the request ends after its first `num_tokens`
    output tokens, with finish_reason "stop" and `stop` as its stop_reason."""
    request_id: str
    index: int
    num_tokens: int
    stop: str


class StopSamples(msgspec.Struct, tag=True):
    """Finish these samples now (their blocks are freed at once); tokens past num_tokens are dropped."""
    items: list[SampleStop]


class Shutdown(msgspec.Struct, tag=True):
    """Abort everything, return every lease, and end the loop."""


# ---- core -> client -------------------------------------------------------------------------------------------
class CoreInfo(msgspec.Struct):
    model: str
    max_model_len: int
    vocab_size: int
    num_total_blocks: int
    pid: int
    startup_seconds: float


class Ready(msgspec.Struct, tag=True):
    info: CoreInfo


class Verdict(msgspec.Struct, array_like=True):
    request_id: str
    error: str | None  # None: queued; else why not
    bad_input: bool = False  # the error is the engine's ValueError (a 400), not a failure of the core (a 500)


class Verdicts(msgspec.Struct, tag=True):
    items: list[Verdict]


class CompletionDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sample gained since the last message: token ids and logprobs only grow. No text: the client
    side decodes (output_processor.py), and logprob entries come with decoded_token None."""
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OutputDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    finished: bool
    completions: list[CompletionDelta]
    prompt_token_ids: list[int] | None = None  # only in a request's first delta
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # likewise
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = {}


class StepOutputs(msgspec.Struct, tag=True):
    step: int  # the core's iteration counter (tests check batching with it)
    outputs: list[OutputDelta]
    iteration: IterationStats
    stats: EngineStats


class Stopped(msgspec.Struct, tag=True):
    """After a Shutdown: every lease is back and the last outputs went out before this; only the process's
    exit remains (which the client need not wait long for: see CoreProcess.stop)."""


class CoreFailed(msgspec.Struct, tag=True):
    message: str


ToCore = Add | Abort | StopSamples | Shutdown
FromCore = Ready | Verdicts | StepOutputs | Stopped | CoreFailed


class Codec:
    """msgpack encoder/decoders for both directions (one per thread: they keep buffers)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.to_core = msgspec.msgpack.Decoder(ToCore)
        self.from_core = msgspec.msgpack.Decoder(FromCore)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self.encoder.encode(msg)


@dataclass(frozen=True)
class Addresses:
    """The two channels of one core. The client binds both: the core, which may restart, connects."""
    to_core: str
    from_core: str

    @classmethod
    def fresh(cls) -> Addresses:
        # ipc:// paths are limited to ~100 bytes (sun_path), so they go in the system temp dir, not the cwd.
        base = os.path.join(tempfile.gettempdir(), f"lamina-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return cls(f"ipc://{base}-in", f"ipc://{base}-out")

    def cleanup(self) -> None:
        for addr in (self.to_core, self.from_core):
            try:
                os.unlink(addr.removeprefix("ipc://"))
            except OSError:
                pass
