"""Gated DeltaNet mixer (Qwen3-Next, Qwen3.5): input projections, causal conv1d, gated delta rule, gated norm.

Its per-sequence state is declared by state_spec(): the conv window "conv" [C, K-1] in the model dtype (it
holds raw inputs) and the recurrent state "ssm" [Hv, dk, dv] in fp32 whatever the model dtype (it integrates
over the whole sequence; HF's and fla's kernels carry it in fp32 too). The engine allocates state-pool rows of
both and binds them here (bind_state); each step addresses them through the step context's state metadata
(ctx.state.slots). A sequence whose chunk starts at position 0 starts from zeros.

Parameter names: one merged `in_proj` with shards qkv | z | b | a. Qwen3.5 checkpoints hold exactly those
four (in_proj_qkv/_z/_b/_a); Qwen3-Next's in_proj_qkvz/in_proj_ba interleave them per key-head group and
are reordered at load time (families/qwen3_next.py), so the forward is one matmul and a split either way.
"""
from __future__ import annotations

import torch
from torch import nn

from lamina.cache.specs import RecurrentStateSpec, StateTensor
from lamina.kernels.conv1d import causal_conv1d_varlen
from lamina.kernels.gated_delta import gated_delta_rule_varlen
from lamina.kernels.gdn_conv_decode import ConvCounters
from lamina.kernels.metadata import StepContext
from lamina.kernels.norm_gated import rms_norm_gated
from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers.gdn_decode_path import fused_conv_recurrent, fused_norm_out_proj
from lamina.models.layers.linear import Linear
from lamina.models.layers.recurrent_state import ConvSsmState

# The recurrent state integrates over the whole sequence: fp32 whatever the model dtype (as HF's and fla's).
RECURRENT_DTYPE = torch.float32


class GatedRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, gate, self.weight, self.eps)


class GatedDeltaNet(ConvSsmState, nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        g = cfg.gdn
        if g is None:
            raise ValueError("a gated_delta_net layer needs ModelConfig.gdn")
        if g.num_v_heads % g.num_k_heads:
            raise ValueError(f"linear value heads {g.num_v_heads} must be a multiple of key heads {g.num_k_heads}")
        self.num_k_heads, self.num_v_heads = g.num_k_heads, g.num_v_heads
        self.head_k_dim, self.head_v_dim = g.head_k_dim, g.head_v_dim
        self.key_dim, self.value_dim = g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim
        self.conv_dim, self.conv_kernel = g.conv_dim, g.conv_kernel
        self.in_proj = Linear(cfg.hidden_size, {"qkv": self.conv_dim, "z": self.value_dim,
                                                "b": g.num_v_heads, "a": g.num_v_heads}, bias=False)
        # Depthwise: weight [C, 1, K] as HF stores it; applied by the conv1d kernel, never as an nn.Conv1d.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, g.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(g.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(g.num_v_heads))
        self.norm = GatedRMSNorm(g.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported gated delta net activation {cfg.hidden_act!r}")
        self.conv_counters = ConvCounters()  # the fused conv + recurrent decode kernel's (gdn_decode_path)

    def state_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        return RecurrentStateSpec((
            StateTensor("conv", (self.conv_dim, self.conv_kernel - 1), dtype),
            StateTensor("ssm", (self.num_v_heads, self.head_k_dim, self.head_v_dim), RECURRENT_DTYPE)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads],
                                             dim=-1)
        core = fused_conv_recurrent(self, qkv, a, b, ctx)  # decode on CUDA: conv + recurrent step in one launch
        if core is None:
            qkv = causal_conv1d_varlen(qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.conv_state,
                                       ctx.attn, ctx.state, "silu")
            q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            q = q.reshape(t, self.num_k_heads, self.head_k_dim)
            k = k.reshape(t, self.num_k_heads, self.head_k_dim)
            v = v.reshape(t, self.num_v_heads, self.head_v_dim)
            # The decay and rate gates are computed inside the GPU kernels (fused) or by gdn_gates on the CPU.
            core = gated_delta_rule_varlen(q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_state, ctx.attn,
                                           ctx.state)
        z = z.reshape(t, self.num_v_heads, self.head_v_dim)
        out = fused_norm_out_proj(self, core, z)  # decode on CUDA: the gated norm inside the out_proj GEMV
        if out is not None:
            return out
        core = self.norm(core, z)
        return self.out_proj(core.reshape(t, self.value_dim))
