"""Incremental detokenization: turns each new token into text without ever emitting a broken character.

Decoding a single token alone loses the spaces and multi-byte characters that span tokens, so each step
decodes a short window [prefix_offset:] and [prefix_offset:read_offset] and emits the difference, waiting
while the text ends in U+FFFD (an incomplete UTF-8 sequence).
"""
from __future__ import annotations

from lamina.engine.request import DetokState

# Prompt tokens kept as left context so the first output token decodes with its leading space.
_CONTEXT = 6


def initial_state(num_prompt_tokens: int) -> DetokState:
    return DetokState(prefix_offset=max(num_prompt_tokens - _CONTEXT, 0), read_offset=num_prompt_tokens)


def _backend_decode(tokenizer):
    """The Rust tokenizer's own decode, where HF's wrapper adds nothing to it (a fast tokenizer that does not
    clean up spaces): the wrapper's argument conversion cost ~3x the decode itself, twice per streamed token
    (scripts/server_token_cost.py). None: use tokenizer.decode."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend.decode


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._fast = _backend_decode(tokenizer) if tokenizer is not None else None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:  # random-weight benchmark models have no tokenizer: token ids only
            return ""
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def step(self, state: DetokState, token_ids: list[int], skip_special_tokens: bool, end: int | None = None) -> str:
        """Advances `state` over token_ids[:end] (prompt + output so far); returns the newly complete text."""
        end = len(token_ids) if end is None else end
        prefix = self.decode(token_ids[state.prefix_offset:state.read_offset], skip_special_tokens)
        full = self.decode(token_ids[state.prefix_offset:end], skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            state.prefix_offset, state.read_offset = state.read_offset, end
            state.text += new
            return new
        return ""

    def flush(self, state: DetokState, token_ids: list[int], skip_special_tokens: bool) -> str:
        """At the end of a sequence: emits whatever is left, even an incomplete character (as U+FFFD)."""
        if state.read_offset >= len(token_ids):
            return ""
        prefix = self.decode(token_ids[state.prefix_offset:state.read_offset], skip_special_tokens)
        full = self.decode(token_ids[state.prefix_offset:], skip_special_tokens)
        new = full[len(prefix):] if full.startswith(prefix) else full
        state.prefix_offset = state.read_offset = len(token_ids)
        state.text += new
        return new

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)


class DeferredTokenText:
    """Stands in for a Detokenizer where the core builds logprob entries: their `decoded_token` stays None
    and the output side (output_processor.py) fills it, so the step loop decodes nothing."""

    def token_text(self, token_id: int) -> None:
        return None
