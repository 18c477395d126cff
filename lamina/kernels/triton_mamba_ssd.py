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


def mamba_ssd_split_verify_triton(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
                                  C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                                  ssm_states: torch.Tensor, attn, state, dt_min: float = 0.0,
                                  dt_max: float = float("inf")) -> torch.Tensor:
    """A step where some sequences verify drafts and others prefill (state.candidate_slots_cpu set, no device
    candidate table): the verifying sequences' rows through the verify kernel, the rest through the chunked scan,
    each on its own gathered sub-batch (every sequence owns its slot, so the order does not matter). Built from
    the host lists, so an eager path only, as the reference it replaces is."""
    qs, cands = attn.query_start_cpu, state.candidate_slots_cpu
    n = len(qs) - 1
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    verify = [i for i in range(n) if cands[i]]
    rest = [i for i in range(n) if not cands[i]]
    for seqs in (verify, rest):
        if not seqs:
            continue
        lens = [qs[i + 1] - qs[i] for i in seqs]
        rows = torch.tensor([r for i in seqs for r in range(qs[i], qs[i + 1])], dtype=torch.int64, device=x.device)
        starts = [0]
        for m in lens:
            starts.append(starts[-1] + m)
        sub_qs = torch.tensor(starts, dtype=torch.int32, device=x.device)
        idx = torch.tensor(seqs, dtype=torch.int64, device=x.device)
        slots, init = state.slots.index_select(0, idx), state.has_initial_state.index_select(0, idx)
        sx, sdt, sB, sC = (t.index_select(0, rows) for t in (x, dt, B, C))
        if seqs is verify:
            width = max(1, max(lens) - 1)
            table = torch.tensor([cands[i] + [0] * (width - len(cands[i])) for i in seqs], dtype=torch.int64,
                                 device=x.device)
            sy = ssd_verify_triton(sx, sdt, A_log, sB, sC, D, dt_bias, ssm_states, sub_qs, slots, table, init,
                                   max(lens), dt_min, dt_max)
        else:
            sy = ssd_chunked_triton(sx, sdt, A_log, sB, sC, D, dt_bias, ssm_states, sub_qs, slots, init, dt_min,
                                    dt_max)
        y.index_copy_(0, rows, sy)
    return y
