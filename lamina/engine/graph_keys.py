"""Which CUDA graphs exist and which one a step replays: pure functions of sizes, no CUDA needed.

A decode-only step (every sequence computes one token) replays the decode graph of the smallest captured
batch size >= its sequence count. Any other step (prefill chunks, possibly with decode rows; attention-only
and hybrid models alike) replays the mixed graph of the smallest captured token count >= its token count; its
batch has min(tokens, max_num_seqs + 1) sequence slots, one more than the step can use, for the sequence the
padding tokens belong to. So a mixed step's key depends on its token count alone, and its padding waste is
bounded by the ladder's spacing.

Hybrid verify steps (speculative decoding on a model with recurrent state: every sequence carries its last
token plus at most K drafts, and the recurrent layers keep the state after each position) replay verify graphs,
keyed like decode graphs by padded batch size b, for one query-length bound L = K + 1: b * L token rows and 2b
sequence slots (the real sequences, then padding sequences of at most L rows each: ceil((b * L - T) / L) <= b
of them, since every real sequence has at least one row). L fixes the verify kernels' token loop, so padding
rows must come in sequences no longer than the real ones may be.

Token ladder: every multiple of 16 up to 128 (GEMMs over so few rows are bound by weight reads, so padding is
nearly free there), then `per_octave` evenly spaced sizes per doubling: at most 1/per_octave of the rows are
padding (12.5% at the default 8, about 6% on average), with 8 graphs per octave (56 up to 8,192 tokens).
Every size is a multiple of 16, so Triton's divisibility specialisation sees one case and nothing recompiles
per size.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class GraphKey:
    tokens: int  # padded token rows the graph computes
    seqs: int  # padded sequence slots of its batch
    decode: bool  # decode-only graph: one token per sequence (tokens == seqs)
    verify: int = 0  # verify graph (hybrid models): every sequence has at most this many rows; 0 otherwise


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256 + 1, 16))
    return [s for s in sizes if s <= max(max_num_seqs, 1)] or [1]


def mixed_token_sizes(max_tokens: int, per_octave: int = 8) -> list[int]:
    """Ascending multiples of 16 covering 1..max_tokens (the last one is max_tokens rounded up to 16)."""
    if per_octave < 1:
        raise ValueError("per_octave must be >= 1")
    cap = -(-max(max_tokens, 1) // 16) * 16
    sizes = list(range(16, min(cap, 128) + 1, 16))
    lo = 128
    while lo < cap:
        step = max(16, lo // per_octave // 16 * 16)
        sizes += [s for s in range(lo + step, 2 * lo + 1, step) if s <= cap]
        lo *= 2
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def mixed_seq_slots(tokens: int, max_num_seqs: int) -> int:
    """Sequence slots of the mixed graph for `tokens` rows: a step has at most max_num_seqs sequences and at
    most tokens - 1 of them next to a prefill chunk, plus one slot for the padding rows' sequence."""
    return min(tokens, max_num_seqs + 1)


def graph_keys(decode_sizes: list[int], mixed_sizes: list[int], max_num_seqs: int) -> list[GraphKey]:
    return [GraphKey(s, s, True) for s in decode_sizes] + \
        [GraphKey(t, mixed_seq_slots(t, max_num_seqs), False) for t in mixed_sizes]


# A mixed graph's decode split count follows its slot count, not the step's decode rows: a step with a few
# very long contexts in a graph with many more slots would run those rows nearly unsplit (one program per row
# and KV head over 16k+ keys, ~0.5 ms per layer at 32k), which costs more than the eager launches it saves.
# Such steps run eagerly (a per-sequence split count read on the device would remove this rule).
LONG_CONTEXT = 16384
LONG_CONTEXT_SLOT_RATIO = 4


def choose_key(num_tokens: int, num_seqs: int, decode_only: bool, decode_sizes: list[int],
               mixed_sizes: list[int], max_num_seqs: int, max_seq_len: int = 0) -> GraphKey | None:
    """The graph a step of num_tokens rows over num_seqs sequences (longest context max_seq_len) replays, or
    None (run it eagerly)."""
    if num_tokens < 1 or num_seqs < 1:
        return None
    if decode_only:
        i = bisect.bisect_left(decode_sizes, num_seqs)
        if i < len(decode_sizes):
            return GraphKey(decode_sizes[i], decode_sizes[i], True)
        # More sequences than the largest decode graph (max_num_seqs > 256): a mixed graph runs them too.
    i = bisect.bisect_left(mixed_sizes, num_tokens)
    while i < len(mixed_sizes):  # the slot count grows with the size: a later size may fit more sequences
        t = mixed_sizes[i]
        slots = mixed_seq_slots(t, max_num_seqs)
        if slots >= num_seqs + 1:
            if max_seq_len > LONG_CONTEXT and slots > LONG_CONTEXT_SLOT_RATIO * (num_seqs + 1):
                return None
            return GraphKey(t, slots, False)
        i += 1
    return None


def verify_keys(decode_sizes: list[int], width: int) -> list[GraphKey]:
    """The verify graphs for query length bound `width` (K + 1): one per decode batch size; none for width < 2."""
    return [GraphKey(b * width, 2 * b, False, width) for b in decode_sizes] if width >= 2 else []


def choose_verify_key(num_seqs: int, max_query_len: int, decode_sizes: list[int], width: int) -> GraphKey | None:
    """The verify graph of a step of num_seqs sequences (each of at most max_query_len rows), or None."""
    if width < 2 or num_seqs < 1 or max_query_len > width:
        return None
    i = bisect.bisect_left(decode_sizes, num_seqs)
    if i == len(decode_sizes):
        return None
    b = decode_sizes[i]
    return GraphKey(b * width, 2 * b, False, width)


def verify_padding_starts(num_tokens: int, num_seqs: int, key: GraphKey) -> list[int]:
    """query_start[B + 1:] of a verify graph over a step of num_tokens rows in num_seqs = B sequences (the host
    oracle of the device fill in graph_inputs.py): padding sequences of key.verify rows (the last one shorter),
    then empty slots at key.tokens. Entry j is min(num_tokens + (j + 1) * key.verify, key.tokens)."""
    return [min(num_tokens + (j + 1) * key.verify, key.tokens) for j in range(key.seqs - num_seqs)]


def verify_padding_seqs(num_tokens: int, key: GraphKey) -> int:
    """How many padding sequences (non-empty) a verify graph's padding rows form."""
    return -(-(key.tokens - num_tokens) // key.verify)


def padding_waste(num_tokens: int, key: GraphKey) -> float:
    """Fraction of the graph's token rows that are padding."""
    return 1.0 - num_tokens / key.tokens
