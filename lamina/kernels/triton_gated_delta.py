"""GPU gated delta rule for one step: the fused recurrent kernel when every sequence brings one token (decode),
else the chunked kernels over the whole flat batch (prefill, chunked prefill, and mixed batches, whose one-token
rows are simply one-token sequences there). The choice reads max_query_len, which a CUDA graph's metadata fixes
per key (1 for decode graphs, the padded token count for mixed ones), so each graph has one path; both paths
read only device tensors."""
from __future__ import annotations

import torch

from lamina.kernels.gdn_gates import gdn_gates
from lamina.kernels.triton_gdn_chunk import chunk_gated_delta_varlen_triton
from lamina.kernels.triton_gdn_decode import gated_delta_decode_triton


def gated_delta_rule_varlen_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                                   b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                   ssm_states: torch.Tensor | None, attn, state,
                                   use_qk_l2norm: bool = True) -> torch.Tensor:
    """attn: the step's AttentionMetadata; state: its StateMetadata (None: zero state, nothing written)."""
    if state is None:
        ssm_states = None
    slots = state.slots if ssm_states is not None else None
    has_init = state.has_initial_state if state is not None else None
    if attn.max_query_len == 1:
        return gated_delta_decode_triton(q, k, v, a, b, A_log, dt_bias, ssm_states, slots, has_init, use_qk_l2norm)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return chunk_gated_delta_varlen_triton(q, k, v, g, beta, ssm_states, attn.query_start, slots, has_init,
                                           use_qk_l2norm)
