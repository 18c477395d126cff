"""Stop conditions. In the core: stop token ids, EOS and length (check_token_stop). On the output side (the
API server process, or offline LLM's output loop): stop strings found in the new text's tail, and how much
text is safe to show while one could still complete (find_stop, held_back)."""
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


def held_back(text: str, stops: list[str]) -> int:
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


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last `new_len` characters of `text` (the text before
    them was searched already): (its index, the string), or None. Only that tail is searched, plus
    len(stop) - 1 characters before it for a stop that straddles the boundary; the count and length of stop
    strings are capped by SamplingParams.validate, so the cost does not grow with the text."""
    if not stops or new_len <= 0:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, len(text) - new_len - longest + 1)
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or (i, s) < best):  # ties: as min() over (index, string)
            best = (i, s)
    return best

