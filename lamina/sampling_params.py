"""SamplingParams: per-request decoding settings, named and defaulted as in vLLM.

validate() is the one place these are checked (the engine calls it with the model's vocabulary size, the
server maps its errors to 400s): every value that reaches the sampler is in range, so one request's settings
cannot make a batched step fail for the others.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Stop strings are matched against each new piece of text of every sequence that has them: bounded so one
# request cannot slow every step down.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_LEN = 256
# Temperatures below this are greedy (dividing logits by them overflows to garbage).
GREEDY_TEMPERATURE = 1e-5
_INT64 = (-(2**63), 2**63 - 1)


class SamplingParamsError(ValueError):
    """A setting out of range; `param` names the field (the server reports it as the error's param)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # keeps `param` across processes
        return (type(self), (str(self), self.param))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # below 1e-5: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises SamplingParamsError (a ValueError) for any value out of range. With vocab_size, token ids
        and top_k are also checked against the model's vocabulary."""
        def check(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise SamplingParamsError(msg, param)

        check(_is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        check(_is_num(self.temperature) and self.temperature >= 0.0, "temperature",
              f"temperature must be a number >= 0, got {self.temperature!r}")
        check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        top_k_max = vocab_size if vocab_size is not None else 2**31 - 1
        check(_is_int(self.top_k) and 0 <= self.top_k <= top_k_max, "top_k",
              f"top_k must be -1 or 0 (off) or an integer in [1, {top_k_max}], got {self.top_k!r}")
        check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0.0, "repetition_penalty",
              f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(_is_num(v) and -2.0 <= v <= 2.0, name, f"{name} must be in [-2, 2], got {v!r}")
        check(self.seed is None or (_is_int(self.seed) and _INT64[0] <= self.seed <= _INT64[1]), "seed",
              f"seed must be a 64-bit signed integer, got {self.seed!r}")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS), name,
                  f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
              f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        check(all(len(s) <= MAX_STOP_STRING_LEN for s in self.stop), "stop",
              f"stop strings must be at most {MAX_STOP_STRING_LEN} characters long")
        id_max = vocab_size if vocab_size is not None else 2**63
        check(all(_is_int(t) and 0 <= t < id_max for t in self.stop_token_ids), "stop_token_ids",
              "stop_token_ids must be token ids" + (f" in [0, {vocab_size})" if vocab_size is not None else ""))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
