"""Mamba-2 mixer (Nemotron-H, Bamba): in_proj -> (z | xBC | dt), causal conv1d + SiLU over xBC, the SSD scan,
a grouped gated RMSNorm, out_proj.

The split, the conv and the norm follow HF transformers' NemotronHMamba2Mixer / BambaMixer exactly:
  - in_proj's output is z [I] | xBC [I + 2 G N] | dt [H] (I = H * P); xBC goes through the conv, then splits
    into x [H, P] | B [G, N] | C [G, N];
  - the SSD (kernels/mamba_ssd.py) takes dt raw and applies softplus(dt + dt_bias) clamped to [dt_min, dt_max];
    y includes D * x; no z inside;
  - the gated norm multiplies y by silu(z) first, in fp32 (norm_before_gate=False), then RMS-normalizes each
    group of I / G channels, casts back to the model dtype and scales by the weight.

Its per-sequence state is declared by state_spec(): the conv window "conv" [I + 2 G N, K-1] in the model dtype
(raw inputs) and the SSM state "ssm" [H, P, N] in fp32 whatever the model dtype (HF's mamba_ssm_cache_dtype
default, and it integrates over the whole sequence). The engine allocates state-pool rows of both and binds
them (bind_state); a step addresses them through ctx.state (slots, has-initial-state, candidate slots for
speculative verify), so prefix-cache snapshots and rollback copy them like any declared state.
"""
from __future__ import annotations

import torch
from torch import nn

from lamina.cache.specs import RecurrentStateSpec, StateTensor
from lamina.kernels.conv1d import causal_conv1d_varlen
from lamina.kernels.mamba_ssd import mamba_ssd_varlen
from lamina.kernels.metadata import StepContext
from lamina.kernels.norm_gated_grouped import grouped_gated_rms_norm
from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers.linear import Linear
from lamina.models.layers.recurrent_state import ConvSsmState

SSM_DTYPE = torch.float32


class GroupedGatedRMSNorm(nn.Module):
    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        if size % group_size:
            raise ValueError(f"gated norm width {size} is not a multiple of its group size {group_size}")
        self.weight = nn.Parameter(torch.empty(size))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return grouped_gated_rms_norm(y, z, self.weight, self.group_size, self.eps)


class Mamba2Mixer(ConvSsmState, nn.Module):
    """Held as `self_attn` like every mixer (HF: `mixer` in Nemotron-H, `mamba` in Bamba; families map it).

    Parameters, named as HF's: in_proj (one matmul, z | xBC | dt), conv1d.weight [C, 1, K] (+ bias), dt_bias,
    A_log, D [H], norm.weight [I], out_proj."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        m = cfg.mamba2
        if m is None:
            raise ValueError("a mamba2 layer needs ModelConfig.mamba2")
        if m.num_heads % m.n_groups:
            raise ValueError(f"mamba heads {m.num_heads} must be a multiple of groups {m.n_groups}")
        self.num_heads, self.head_dim, self.state_size = m.num_heads, m.head_dim, m.state_size
        self.n_groups = m.n_groups
        self.intermediate, self.conv_dim, self.conv_kernel = m.intermediate_size, m.conv_dim, m.conv_kernel
        self.chunk_size, self.dt_min, self.dt_max = m.chunk_size, m.dt_min, m.dt_max
        self.in_proj = Linear(cfg.hidden_size, self.intermediate + self.conv_dim + self.num_heads, bias=m.proj_bias)
        # Depthwise: weight [C, 1, K] as HF stores it; applied by the conv1d kernel, never as an nn.Conv1d.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, m.conv_kernel, groups=self.conv_dim,
                                bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GroupedGatedRMSNorm(self.intermediate, self.intermediate // self.n_groups, m.norm_eps)
        self.out_proj = Linear(self.intermediate, cfg.hidden_size, bias=m.proj_bias)

    def state_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        return RecurrentStateSpec((
            StateTensor("conv", (self.conv_dim, self.conv_kernel - 1), dtype),
            StateTensor("ssm", (self.num_heads, self.head_dim, self.state_size), SSM_DTYPE)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        gn = self.n_groups * self.state_size
        z, xbc, dt = self.in_proj(x).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        xbc = causal_conv1d_varlen(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.conv_state,
                                   ctx.attn, ctx.state, "silu")
        xs, b, c = xbc.split([self.intermediate, gn, gn], dim=-1)
        y = mamba_ssd_varlen(xs.reshape(t, self.num_heads, self.head_dim), dt, self.A_log,
                             b.reshape(t, self.n_groups, self.state_size), c.reshape(t, self.n_groups, self.state_size),
                             self.D, self.dt_bias, self.ssm_state, ctx.attn, ctx.state, dt_min=self.dt_min,
                             dt_max=self.dt_max, chunk_size=self.chunk_size)
        y = self.norm(y.reshape(t, self.intermediate), z)
        return self.out_proj(y)
