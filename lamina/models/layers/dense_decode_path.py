"""Decode path of a dense attention + gated-MLP DecoderLayer (Llama, Qwen2/3, Mistral...): the three small ops
between the linears run as prologues of the Triton decode GEMV (triton_gemv.Prologue), so a layer launches
7 kernels instead of 10 at batch 1 (GPU_KERNELS.md lists them):

    input (add +) RMSNorm -> qkv GEMV       post-attention add + RMSNorm -> gate|up GEMV
    SiLU(gate) * up -> down GEMV

The H200 profile of 2026-12-02 (Qwen3-8B, batch 1, graphs) put the three at 2.5 + 2.5 + 2.1 us per layer,
all launch and ramp time (their bytes are a few KB): 255 us of a 4,802 us step over 36 layers.

Taken when the GEMV dispatcher takes the call (LAMINA_TRITON_GEMV=1, CUDA, <= 16 rows, dense unpartitioned
weights) and LAMINA_FUSED_DENSE_DECODE is not "0"; each linear whose GEMV declines falls back to the
separate ops, so the path is never wrong, only unfused. The residual stream is the same tensor contents as
the separate add + norm writes (x + residual rounded to the stream dtype); the normalized input is not
materialized (the GEMV scales its accumulator by 1/rms, see triton_gemv.Prologue).
"""
from __future__ import annotations

import os

import torch

from lamina.kernels.metadata import StepContext
from lamina.models.layers.linear import Linear
from lamina.models.layers.norm import RMSNorm

ENV_SWITCH = "LAMINA_FUSED_DENSE_DECODE"


def applies(layer, x: torch.Tensor) -> bool:
    """Plain attention + gated MLP (types checked exactly: subclasses change forward) on a CUDA decode batch
    the GEMV would take, and the switch not off. Read per call, like the other decode paths' switches."""
    from lamina.models.layers.attention import Attention
    from lamina.models.layers.mlp import GatedMLP

    return (os.environ.get(ENV_SWITCH, "1") != "0" and type(layer.self_attn) is Attention
            and type(layer.mlp) is GatedMLP and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm
            and layer.self_attn.qkv_proj.takes_prologue(x))


def norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual); residual None: (linear(norm(x)), x)."""
    from lamina.kernels.triton_gemv import Prologue

    if not linear.takes_prologue(x) or norm.weight.dim() != 1 or not norm.weight.is_contiguous():
        if residual is None:
            return linear(norm(x)), x
        h, residual = norm(x, residual)
        return linear(h), residual
    if residual is None:
        return linear(x, prologue=Prologue("norm", norm.weight, norm.eps, norm.offset)), x
    summed = torch.empty_like(x)
    y = linear(x, prologue=Prologue("add_norm", norm.weight, norm.eps, norm.offset, residual.contiguous(), summed))
    return y, summed


def act_linear(mlp, h: torch.Tensor) -> torch.Tensor:
    """mlp.down_proj(act(h)) with the activation in the GEMV; h: the gate|up projection."""
    from lamina.kernels.triton_gemv import Prologue

    if not mlp.down_proj.takes_prologue(h, act=True):
        return mlp.down_proj(mlp.act(h))
    return mlp.down_proj(h, prologue=Prologue(mlp.act_kind))


def forward(layer, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
            ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """DecoderLayer.forward with the norms and the activation folded into the GEMVs."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, residual = norm_linear(layer.input_layernorm, attn.qkv_proj, x.contiguous(), residual)
    h = attn.forward_qkv(qkv, positions, ctx)
    gu, residual = norm_linear(layer.post_attention_layernorm, mlp.gate_up_proj, h, residual)
    return act_linear(mlp, gu), residual
