"""GDN decode step with its conv update fused in (triton_gdn_conv_decode.py): the reference composes the two
unfused references (causal_conv1d_varlen_ref on the decode rows, then the recurrent gated delta rule), and
`ConvCounters` owns the fused kernel's per-(row, key head) counters for one layer."""
from __future__ import annotations

import torch

from lamina.kernels.conv1d import causal_conv1d_varlen_ref
from lamina.kernels.gated_delta import gated_delta_rule_varlen_ref
from lamina.kernels.gdn_gates import gdn_gates

COUNTER_ROWS = 1024  # batch rows the counters cover (a larger decode batch takes the unfused path)


def gdn_conv_decode_ref(x: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                        conv_states: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                        dt_bias: torch.Tensor, ssm_states: torch.Tensor | None, slots: list[int] | None,
                        has_init: list[bool], num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
                        use_qk_l2norm: bool = True) -> torch.Tensor:
    """One token per sequence: x [B, C] raw qkv rows -> core [B, Hv, dv]; both pools updated at `slots`."""
    bsz = x.shape[0]
    starts = list(range(bsz + 1))
    qkv = causal_conv1d_varlen_ref(x, conv_weight, conv_bias, conv_states, starts, slots, has_init, "silu")
    key_dim = num_k_heads * head_k_dim
    q, k, v = qkv.split([key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return gated_delta_rule_varlen_ref(q.reshape(bsz, num_k_heads, head_k_dim), k.reshape(bsz, num_k_heads, head_k_dim),
                                       v.reshape(bsz, num_v_heads, head_v_dim), g, beta, ssm_states, starts, slots,
                                       has_init, use_qk_l2norm)


class ConvCounters:
    """The fused kernel's counters for one layer, allocated on first use (never while a graph is captured:
    `get` then returns None and the caller takes the unfused path)."""

    def __init__(self) -> None:
        self._counters: torch.Tensor | None = None

    def get(self, rows: int, num_k_heads: int, device: torch.device) -> torch.Tensor | None:
        if rows > COUNTER_ROWS:
            return None
        c = self._counters
        if c is None or c.device != device or c.numel() < COUNTER_ROWS * num_k_heads:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            from lamina.kernels.triton_gdn_conv_decode import new_conv_counters

            c = self._counters = new_conv_counters(COUNTER_ROWS, num_k_heads, device)
        return c
