"""Triton causal conv1d for verify steps: the conv over each sequence's chunk (its last token plus its drafts),
and the conv state after every position but the last written into that sequence's candidate slots, so a
rejected draft rolls back by copying a candidate (lamina/engine/readback.py) instead of recomputing.

Contract: lamina.kernels.conv1d.causal_conv1d_varlen_ref with candidate_slots (device tensors instead of
python lists). Sequence b owns rows query_start[b]..query_start[b+1] (L_b tokens); candidates [B, >= max L - 1]
int64 holds its L_b - 1 candidate slots first (the rest of the row is never read). The state after chunk
token j is the window of the K-1 inputs ending at j, i.e. columns j+1 .. j+K-1 of (old state | chunk).

Two launches on the stream, in this order:
1. `_conv1d_windows_kernel`, grid (B, max L - 1, cdiv(C, BLOCK_C)): program (b, j) writes the window after
   token j to conv_states[candidates[b, j]] (j >= L_b - 1 exits). It reads the old state of b's own slot,
   which only the second launch overwrites, and writes candidate slots, which no program reads: race free.
2. The varlen conv kernel (triton_conv1d.py) for the outputs and the state after the last token in b's own
   slot, exactly as a plain step.
Grids come from shapes (B, the candidates' width, C); lengths, slots and flags are read on the device, so
the pair can be captured in a CUDA graph with the verify step's padded batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_conv1d import causal_conv1d_varlen_triton


@triton.jit
def _conv1d_windows_kernel(x_ptr, state_ptr, qs_ptr, slot_ptr, init_ptr, cand_ptr, C, stride_x, stride_ss,
                           stride_sc, stride_sk, stride_cand, K: tl.constexpr, KP: tl.constexpr,
                           BLOCK_C: tl.constexpr, HAS_INIT: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    start = tl.load(qs_ptr + b)
    length = tl.load(qs_ptr + b + 1) - start
    if j >= length - 1:  # the state after the last token goes to the sequence's own slot (second launch)
        return
    start = start.to(tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    i = tl.arange(0, KP)
    im = i < K - 1
    q = j + 1 + i - (K - 1)  # chunk position of window column i (< 0: a column of the old state)
    from_x = (q >= 0) & im
    win = tl.load(x_ptr + (start + q)[None, :] * stride_x + cols[:, None], mask=cmask[:, None] & from_x[None, :],
                  other=0.0).to(state_ptr.dtype.element_ty)
    own = state_ptr + tl.load(slot_ptr + b).to(tl.int64) * stride_ss
    live = True
    if HAS_INIT:
        live = tl.load(init_ptr + b) != 0
    from_s = (q < 0) & im & live
    old = tl.load(own + cols[:, None] * stride_sc + (q + (K - 1))[None, :] * stride_sk,
                  mask=cmask[:, None] & from_s[None, :], other=0.0)
    win = tl.where(from_x[None, :], win, old)  # a fresh sequence's missing state columns are zeros
    dst = state_ptr + tl.load(cand_ptr + b * stride_cand + j).to(tl.int64) * stride_ss
    tl.store(dst + cols[:, None] * stride_sc + i[None, :] * stride_sk, win, mask=cmask[:, None] & im[None, :])


def causal_conv1d_verify_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                conv_states: torch.Tensor, query_start: torch.Tensor, state_slots: torch.Tensor,
                                candidates: torch.Tensor, has_initial_state: torch.Tensor | None, max_query_len: int,
                                activation: str | None = "silu", *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] -> act(conv) [T, C]; conv_states [slots, C, K-1]: the state after each sequence's chunk token j
    (j < L_b - 1) in candidates[b, j], after its last token in state_slots[b]. has_initial_state None: every
    sequence starts from a zero state."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, c = x.shape
    k = weight.shape[-1]
    b = query_start.shape[0] - 1
    assert conv_states.shape[1:] == (c, k - 1) and candidates.dim() == 2 and candidates.shape[0] == b
    assert candidates.stride(-1) == 1 and query_start.stride(0) == 1 and state_slots.stride(0) == 1
    width = candidates.shape[1]
    if t and b > 0 and max_query_len > 1 and width > 0:
        init = query_start
        if has_initial_state is not None:
            init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
        block_c = min(256, triton.next_power_of_2(c))
        ss = conv_states.stride()
        _conv1d_windows_kernel[(b, width, triton.cdiv(c, block_c))](
            x, conv_states, query_start, state_slots, init, candidates, c, x.stride(0), ss[0], ss[1], ss[2],
            candidates.stride(0), K=k, KP=triton.next_power_of_2(k - 1), BLOCK_C=block_c,
            HAS_INIT=has_initial_state is not None, num_warps=4)
    return causal_conv1d_varlen_triton(x, weight, bias, conv_states, query_start, state_slots, has_initial_state,
                                       max_query_len, activation, out=out)
