"""Causal depthwise conv1d with a rolling state, as the gated delta net (and Mamba) layers use it.

Each sequence's conv state holds the last K-1 inputs it has seen ([C, K-1], oldest first), so a chunk of
new tokens convolves over (state | chunk) and the state becomes the last K-1 columns of that. Prefill,
chunked prefill and decode are the same operation with different chunk lengths; a sequence starting at
position 0 uses a zero state (what zero padding gives on the whole prompt).

States live in a pool tensor conv_states [num_slots, C, K-1] addressed by per-sequence slot indices.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.dispatch import use_triton
from lamina.kernels.metadata import StateMetadata
from lamina.kernels.slot_states import read_states, write_states


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported conv activation {activation!r}")


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                      activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, L, C] (B sequences of equal chunk length L); weight: [C, K]; state: [B, C, K-1].

    Returns (out [B, L, C], new state [B, C, K-1]). Computed in the weight's dtype with F.conv1d, like HF.
    """
    b, l, c = x.shape
    k = weight.shape[-1]
    full = torch.cat([state.to(weight.dtype), x.transpose(1, 2).to(weight.dtype)], dim=-1)  # [B, C, K-1+L]
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=c)  # [B, C, L]: no padding, the state is the pad
    new_state = full[:, :, full.shape[-1] - (k - 1):]
    return _activate(out, activation).transpose(1, 2).to(x.dtype), new_state


def causal_conv1d_varlen_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor | None, query_start: list[int], state_slots: list[int] | None,
                             has_initial_state: list[bool], activation: str | None = "silu",
                             candidate_slots: list[list[int]] | None = None) -> torch.Tensor:
    """x: [T, C], the chunks of several sequences concatenated (query_start: [B+1] row offsets).

    Reads each sequence's state from conv_states[slot] (zeros where has_initial_state is False) and writes
    the new one back. conv_states None (no pool bound, e.g. a profiling pass): zero state, nothing written.
    Single-token rows (decode) run as one batch; each longer chunk runs alone (the reference is a loop).
    candidate_slots (verify steps): sequence i's window after its chunk's token j also goes to
    conv_states[candidate_slots[i][j]] (every token but the last), for rolling back rejected drafts.
    """
    out = torch.empty_like(x)
    k = weight.shape[-1]
    n = len(query_start) - 1
    lens = [query_start[i + 1] - query_start[i] for i in range(n)]
    groups = [[i for i in range(n) if lens[i] == 1]]
    groups = [g for g in groups if g] + [[i] for i in range(n) if lens[i] > 1]
    for rows in groups:
        l = lens[rows[0]]
        xs = torch.stack([x[query_start[i]:query_start[i] + l] for i in rows])  # [B, L, C]
        state = read_states(conv_states, rows, state_slots, has_initial_state,
                            (len(rows), x.shape[1], k - 1), weight.dtype, x.device)
        y, new_state = causal_conv1d_ref(xs, weight, bias, state, activation)
        if l == 1:
            out.index_copy_(0, torch.tensor([query_start[i] for i in rows], device=x.device), y[:, 0])
        else:
            out[query_start[rows[0]]:query_start[rows[0]] + l] = y[0]
            cands = candidate_slots[rows[0]] if candidate_slots is not None and conv_states is not None else []
            if cands:  # the window after token j: the K-1 inputs ending there, of (old state | chunk)
                full = torch.cat([state[0], xs[0].transpose(0, 1).to(weight.dtype)], dim=-1)
                windows = torch.stack([full[:, j + 1:j + k] for j in range(len(cands))])
                conv_states.index_copy_(0, torch.tensor(cands, device=x.device), windows.to(conv_states.dtype))
        write_states(conv_states, rows, state_slots, new_state)
    return out


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor | None, attn: AttentionMetadata, state: StateMetadata | None,
                         activation: str | None = "silu") -> torch.Tensor:
    """The layer's conv over one step's flat batch (attn: its row layout; state: its slots). The GPU kernel
    reads only device tensors (graph-safe); the reference the host lists. state None: zero state."""
    if state is None:
        conv_states = None
    # Verify steps keep the state after every draft position: the Triton verify path when the step holds only
    # verify chunks and single tokens (the device candidate table exists), else the reference.
    if use_triton(x) and state is not None and state.candidate_slots is not None and conv_states is not None:
        from lamina.kernels.triton_conv1d_verify import causal_conv1d_verify_triton

        return causal_conv1d_verify_triton(x, weight, bias, conv_states, attn.query_start, state.slots,
                                           state.candidate_slots, state.has_initial_state, attn.max_query_len,
                                           activation)
    if use_triton(x) and (state is None or state.candidate_slots_cpu is None):
        from lamina.kernels.triton_conv1d import causal_conv1d_varlen_triton

        return causal_conv1d_varlen_triton(x, weight, bias, conv_states, attn.query_start,
                                           state.slots if state is not None else None,
                                           state.has_initial_state if state is not None else None,
                                           attn.max_query_len, activation)
    return causal_conv1d_varlen_ref(x, weight, bias, conv_states, attn.query_start_cpu,
                                    state.slots_cpu if state is not None else None,
                                    state.has_initial_state_cpu if state is not None else [False] * attn.num_seqs,
                                    activation, state.candidate_slots_cpu if state is not None else None)
