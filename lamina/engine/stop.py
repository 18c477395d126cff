"""Stop conditions: stop token ids, EOS, stop strings, length; and how much text is safe to show."""
from __future__ import annotations

from lamina.engine.request import Sequence


def check_token_stop(seq: Sequence, token: int, n_out: int, eos: list[int], max_model_len: int) -> None:
    """Whether the n_out-th output token `token` ends the sequence (later tokens may already be in flight)."""
    p = seq.params
    if n_out > p.min_tokens:  # the sampler banned stops for the first min_tokens tokens
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return
        if not p.ignore_eos and token in eos:
            seq.finish_reason = "stop"
            return
    if n_out >= seq.max_tokens or seq.num_prompt_tokens + n_out >= max_model_len:
        seq.finish_reason = "length"


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that could still grow into a stop string. Only the last
    len(stop) - 1 characters can, and only from a position holding the stop's first character: a few
    C-level string calls per stop, whatever the text's length."""
    hold = 0
    for s in stops:
        width = min(len(s) - 1, len(text))
        if width <= hold:
            continue
        tail = text[len(text) - width:]
        i = tail.find(s[0])
        while 0 <= i < width - hold:  # leftmost match = longest held suffix; shorter ones cannot beat `hold`
            if s.startswith(tail[i:]):
                hold = width - i
                break
            i = tail.find(s[0], i + 1)
    return hold


def apply_stop_strings(seq: Sequence, new_text_len: int) -> None:
    """Updates seq.text from seq.detok.text, cutting at the first stop string that appeared. Only the new
    text's tail is searched (plus len(stop) - 1 characters before it, for a stop that straddles the
    boundary); the count and length of stop strings are capped by SamplingParams.validate."""
    full, stops = seq.detok.text, seq.params.stop
    if stops and seq.finish_reason is None and seq.num_output_tokens >= seq.params.min_tokens:
        longest = max(len(s) for s in stops)
        start = max(0, len(full) - new_text_len - longest + 1)
        hits = [(full.find(s, start), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            idx, s = min(hits)
            seq.finish_reason, seq.stop_reason = "stop", s
            seq.text = full[: idx + (len(s) if seq.params.include_stop_str_in_output else 0)]
            return
    if seq.finish_reason is not None or not stops:
        seq.text = full
    else:
        seq.text = full[: len(full) - _held_back(full, stops)]
