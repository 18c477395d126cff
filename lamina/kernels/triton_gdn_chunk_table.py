"""The chunk table of the chunked gated delta rule, built on the device from the step's query starts.

Sequence b's 64-token chunks are numbered from key[b] = query_start[b] // 64 + b. key is strictly increasing,
and sequence b's ceil(len_b / 64) chunks end at or before key[b + 1] (query_start[b] // 64 + ceil(len_b / 64)
<= query_start[b + 1] // 64 + 1), so every chunk of a batch of T rows in B sequences has its own index below
num_chunks(T, B) = T // 64 + B. That bound depends only on the shapes, so a CUDA graph captured for T_pad rows
and S sequence slots sizes every chunk grid from it, and the table is filled at replay from the device copy of
query_start: no host list, no device-to-host copy. Indices no chunk owns (a sequence's tail after its last
chunk, empty padding sequences) are empty: start = end = 0, and the chunk kernels' programs for them store
nothing (every row masked).

Layout (int32, [2 * num_chunks + B]): chunk starts, chunk ends (exclusive), then key[b] (sequence b's first
chunk index) for the sequential state pass. `chunk_table_host` is the same function of a host list: the
oracle of the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BT = 64  # chunk size (triton_gdn_chunk.BT)
BLOCK = 128  # chunk indices per program of the table kernel


def num_chunks(num_tokens: int, num_seqs: int) -> int:
    """The chunk indices a batch of num_tokens rows in num_seqs sequences may use (host shapes only)."""
    return num_tokens // BT + num_seqs


@triton.jit(do_not_specialize=["num_seqs", "n_chunks", "n_steps"])
def _chunk_table_kernel(qs_ptr, tab_ptr, num_seqs, n_chunks, n_steps, BT: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cm = c < n_chunks
    # b = the last sequence whose first chunk index is <= c: a vectorised binary search over [0, num_seqs)
    # (key[0] = 0 <= c, so b >= 0). n_steps = ceil(log2(num_seqs + 1)) halvings close every interval.
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + num_seqs
    for _ in range(n_steps):
        open_ = lo < hi
        mid = (lo + hi) // 2
        key = tl.load(qs_ptr + mid, mask=cm & open_, other=0) // BT + mid
        right = key <= c
        lo = tl.where(open_ & right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    b = lo - 1
    q0 = tl.load(qs_ptr + b, mask=cm, other=0)
    q1 = tl.load(qs_ptr + b + 1, mask=cm, other=0)
    start = q0 + (c - (q0 // BT + b)) * BT
    used = start < q1
    tl.store(tab_ptr + c, tl.where(used, start, 0), mask=cm)
    tl.store(tab_ptr + n_chunks + c, tl.where(used, tl.minimum(start + BT, q1), 0), mask=cm)
    # the first-chunk index of each sequence (programs cover n_chunks >= num_seqs indices)
    sm = c < num_seqs
    qb = tl.load(qs_ptr + c, mask=sm, other=0)
    tl.store(tab_ptr + 2 * n_chunks + c, qb // BT + c, mask=sm)


def chunk_table_device(query_start: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, int]:
    """query_start: int32 [B + 1] on the device (query_start[B] == num_tokens). Returns (table, num_chunks);
    one kernel launch, graph-capturable (grid and arguments from shapes only)."""
    b = query_start.shape[0] - 1
    nc = num_chunks(num_tokens, b)
    tab = torch.empty(2 * nc + b, dtype=torch.int32, device=query_start.device)
    if b < 1:
        return tab, nc
    assert query_start.dtype == torch.int32 and query_start.stride(0) == 1
    _chunk_table_kernel[(triton.cdiv(nc, BLOCK),)](query_start, tab, b, nc, b.bit_length(), BT=BT, BLOCK=BLOCK)
    return tab, nc


def chunk_table_host(query_start_cpu: list[int], num_tokens: int) -> tuple[list[int], int]:
    """The same table from a host list (the test oracle)."""
    b = len(query_start_cpu) - 1
    nc = num_chunks(num_tokens, b)
    starts, ends = [0] * nc, [0] * nc
    first = [query_start_cpu[i] // BT + i for i in range(b)]
    for i in range(b):
        s, e = query_start_cpu[i], query_start_cpu[i + 1]
        for j, t in enumerate(range(s, e, BT)):
            starts[first[i] + j], ends[first[i] + j] = t, min(t + BT, e)
    return starts + ends + first, nc
