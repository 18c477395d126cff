"""GPU Mamba-2 SSD for one step: the state-update kernel when every sequence brings one token (decode), the
verify kernel for speculative verify steps, else the chunked scan over the whole flat batch (prefill, chunked
prefill, and mixed batches, whose one-token rows are one-token sequences there). The choice reads
max_query_len, which a CUDA graph's metadata fixes per key (1 for decode graphs, the padded token count for
mixed ones), so each graph has one path; every path reads only device tensors.

Kernels: triton_mamba_ssd_decode.py (decode, verify), triton_mamba_ssd_chunk.py (the chunked scan)."""
from __future__ import annotations

import torch

from lamina.kernels.triton_mamba_ssd_chunk import ssd_chunked_triton
from lamina.kernels.triton_mamba_ssd_decode import ssd_decode_triton, ssd_verify_triton


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def mamba_ssd_varlen_triton(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
                            C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor | None,
                            attn, state, dt_min: float = 0.0, dt_max: float = float("inf"),
                            chunk_size: int | None = None) -> torch.Tensor:
    """attn: the step's AttentionMetadata; state: its StateMetadata (None: zero state, nothing written).
    chunk_size is the reference's; the kernels choose their own chunk tile (the result does not depend on it)."""
    del chunk_size
    x, B, C = _rows(x), _rows(B), _rows(C)
    if state is None:
        ssm_states = None
    slots = state.slots if ssm_states is not None else None
    has_init = state.has_initial_state if state is not None else None
    if attn.max_query_len == 1:
        return ssd_decode_triton(x, dt, A_log, B, C, D, dt_bias, ssm_states, slots, has_init, dt_min, dt_max)
    return ssd_chunked_triton(x, dt, A_log, B, C, D, dt_bias, ssm_states, attn.query_start, slots, has_init, dt_min,
                              dt_max)


def mamba_ssd_verify_triton(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
                            C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor,
                            query_start: torch.Tensor, state_slots: torch.Tensor, candidates: torch.Tensor,
                            has_initial_state: torch.Tensor, max_len: int, dt_min: float = 0.0,
                            dt_max: float = float("inf")) -> torch.Tensor:
    """A verify step (every sequence a verify chunk or one token): the state after every draft position goes to
    its candidate slot (StateMetadata.candidate_slots), the last one to the sequence's own slot."""
    return ssd_verify_triton(_rows(x), dt, A_log, _rows(B), _rows(C), D, dt_bias, ssm_states, query_start,
                             state_slots, candidates, has_initial_state, max_len, dt_min, dt_max)
