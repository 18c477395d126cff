"""SamplingParams: per-request decoding settings, named and defaulted as in vLLM.

validate() is the one place these are checked (the engine calls it with the model's vocabulary size, the
server maps its errors to 400s): every value that reaches the sampler is in range, so one request's settings
cannot make a batched step fail for the others.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lamina.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
# Stop strings are matched against each new piece of text of every sequence that has them: bounded so one
# request cannot slow every step down.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_LEN = 256
# Temperatures below this are greedy (dividing logits by them overflows to garbage).
GREEDY_TEMPERATURE = 1e-5
_INT64 = (-(2**63), 2**63 - 1)
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on logit_bias values
MAX_BAD_WORDS = 64


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
    # Logits controls: added to the logits of these ids; only these ids may be sampled; never these words.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Tokenized bad words (the engine fills this from bad_words with its tokenizer; callers may give ids).
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = _int_keys(self.logit_bias)
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
        self._validate_controls(check, vocab_size)

    def _validate_controls(self, check, vocab_size: int | None) -> None:
        vocab = f" (the vocabulary has {vocab_size} tokens)" if vocab_size is not None else ""
        id_max = vocab_size if vocab_size is not None else 2**63
        for tok, bias in (self.logit_bias or {}).items():
            check(_is_int(tok) and 0 <= tok < id_max, "logit_bias",
                  f"logit_bias has token id {tok}, which is not in the vocabulary{vocab}")
            check(_is_num(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias",
                  f"logit_bias for token id {tok} must be in [-100, 100], got {bias!r}")
        if self.allowed_token_ids is not None:
            check(isinstance(self.allowed_token_ids, list) and len(self.allowed_token_ids) > 0,
                  "allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
            for tok in self.allowed_token_ids:
                check(_is_int(tok) and 0 <= tok < id_max, "allowed_token_ids",
                      f"allowed_token_ids has token id {tok}, which is not in the vocabulary{vocab}")
        words = self.bad_words or []
        check(isinstance(words, list) and all(isinstance(w, str) and w for w in words), "bad_words",
              "bad_words must be a list of non-empty strings")
        check(len(words) <= MAX_BAD_WORDS, "bad_words", f"at most {MAX_BAD_WORDS} bad_words are allowed")
        for ids in self.bad_words_token_ids or []:
            check(isinstance(ids, list) and ids and all(_is_int(t) and 0 <= t < id_max for t in ids),
                  "bad_words", f"bad word token ids must be non-empty lists of ids in the vocabulary{vocab}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _int_keys(bias: dict[Any, Any]) -> dict[int, float]:
    """logit_bias keys arrive as strings from JSON: token ids."""
    out = {}
    for k, v in bias.items():
        try:
            out[int(k)] = v
        except (TypeError, ValueError):
            raise SamplingParamsError(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
    return out
