"""Decode path of a dense attention + gated-MLP DecoderLayer (Llama, Qwen2/3, Mistral...): the three small ops
between the linears run as prologues of the Triton decode GEMV (triton_gemv.Prologue), so a layer launches
7 kernels instead of 10 at batch 1 (GPU_KERNELS.md lists them):

    input (add +) RMSNorm -> qkv GEMV       post-attention add + RMSNorm -> gate|up GEMV
    SiLU(gate) * up -> down GEMV

The H200 profile of 2026-12-02 (Qwen3-8B, batch 1, graphs) put the three at 2.5 + 2.5 + 2.1 us per layer,
all launch and ramp time (their bytes are a few KB): 255 us of a 4,802 us step over 36 layers.

Which fusions, from LAMINA_FUSED_DENSE_DECODE (read per call, like the other decode paths' switches):
"0" none; "1" the three prologues above (pro_in, pro_post, pro_act); unset or "epi" the producer-side
epilogues (epi_post, epi_act); or a comma list of the names. The default is "epi" since both whole-step runs
(Qwen3-8B, batch 1, graphs) put it ahead of the prologues: H200 2026-12-02 4,657 vs 5,136 us, H100 2026-12-07
5,837 vs 6,117 (GEMV without fusions 4,707 and 5,859).

    pro_in    input (add +) RMSNorm as the qkv GEMV's prologue
    pro_post  post-attention add + RMSNorm as the gate|up GEMV's prologue
    pro_act   SiLU(gate) * up as the down GEMV's prologue
    epi_post  post-attention add + RMSNorm as the o_proj GEMV's epilogue (its last program normalizes the
              row; gate|up then runs plain)
    epi_act   SiLU(gate) * up as the gate|up GEMV's epilogue (each program owns both halves' rows; down
              then runs plain)

An epilogue wins over the prologue it replaces. Why both kinds: a prologue is redone by every program of the
consumer (each loads the norm weight, the residual, or both activation halves next to its weight tiles), which
the H200 measured slower than the separate launch (138 vs 132 us per layer at batch 1, 374 vs 145 at 8);
an epilogue runs once per output element in the producer, whose tiles are already in registers.

Taken when the GEMV dispatcher takes the call (LAMINA_TRITON_GEMV=1, CUDA, <= 16 rows, dense unpartitioned
weights); each linear whose GEMV declines falls back to the separate ops, so the path is never wrong, only
unfused. The residual stream is the same tensor contents as the separate add + norm writes (x + residual
rounded to the stream dtype).
"""
from __future__ import annotations

import os

import torch

from lamina.kernels.metadata import StepContext
from lamina.models.layers.linear import Linear
from lamina.models.layers.norm import RMSNorm

ENV_SWITCH = "LAMINA_FUSED_DENSE_DECODE"


FUSIONS = ("pro_in", "pro_post", "pro_act", "epi_post", "epi_act")
_ALIASES = {"1": ("pro_in", "pro_post", "pro_act"), "epi": ("epi_post", "epi_act"), "0": ()}


def fusions() -> frozenset[str]:
    """The fusions LAMINA_FUSED_DENSE_DECODE names (see the module doc); unknown names raise."""
    val = os.environ.get(ENV_SWITCH, "epi").strip()
    names = _ALIASES.get(val)
    if names is None:
        names = tuple(n.strip() for n in val.split(",") if n.strip())
        bad = [n for n in names if n not in FUSIONS]
        if bad:
            raise ValueError(f"{ENV_SWITCH}: unknown fusions {bad} (known: {', '.join(FUSIONS)}, or 0 / 1 / epi)")
    return frozenset(names)


def applies(layer, x: torch.Tensor) -> bool:
    """Plain attention + gated MLP (types checked exactly: subclasses change forward) on a CUDA decode batch
    the GEMV would take, and the switch not off. Read per call, like the other decode paths' switches."""
    from lamina.models.layers.attention import Attention
    from lamina.models.layers.mlp import GatedMLP

    # Cheapest first: the CPU path asks this per layer per step (the GEMV dispatcher is None unless switched on).
    return (type(layer.self_attn) is Attention and layer.self_attn.qkv_proj.gemv is not None
            and type(layer.mlp) is GatedMLP and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm and bool(fusions())
            and layer.self_attn.qkv_proj.takes_prologue(x))


def norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None,
                fuse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual); residual None: (linear(norm(x)), x). fuse: the norm as
    the GEMV's prologue where it takes one, else the separate ops."""
    from lamina.kernels.triton_gemv import Prologue

    if not fuse or not linear.takes_prologue(x) or norm.weight.dim() != 1 or not norm.weight.is_contiguous():
        if residual is None:
            return linear(norm(x)), x
        h, residual = norm(x, residual)
        return linear(h), residual
    if residual is None:
        return linear(x, prologue=Prologue("norm", norm.weight, norm.eps, norm.offset)), x
    summed = torch.empty_like(x)
    y = linear(x, prologue=Prologue("add_norm", norm.weight, norm.eps, norm.offset, residual.contiguous(), summed))
    return y, summed


def act_linear(mlp, h: torch.Tensor, fuse: bool = True) -> torch.Tensor:
    """mlp.down_proj(act(h)) with the activation in the GEMV (fuse and it takes it); h: the gate|up output."""
    from lamina.kernels.triton_gemv import Prologue

    if not fuse or not mlp.down_proj.takes_prologue(h, act=True):
        return mlp.down_proj(mlp.act(h))
    return mlp.down_proj(h, prologue=Prologue(mlp.act_kind))


def linear_add_norm(linear: Linear, norm: RMSNorm, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(norm(linear(x) + residual), linear(x) + residual) with the add + norm as the GEMV's epilogue; None
    where the GEMV does not take it (the caller runs the separate ops)."""
    from lamina.kernels.triton_gemv import Epilogue

    if not linear.takes_prologue(x) or norm.weight.dim() != 1 or not norm.weight.is_contiguous():
        return None
    normed = torch.empty(residual.shape, dtype=x.dtype, device=x.device)
    summed = linear(x, epilogue=Epilogue("add_norm", norm.weight, norm.eps, norm.offset, residual.contiguous(),
                                         normed))
    return normed, summed


def linear_act(mlp, h: torch.Tensor) -> torch.Tensor | None:
    """act(mlp.gate_up_proj(h)) with the activation as the GEMV's epilogue; None where it does not take it."""
    from lamina.kernels.triton_gemv import Epilogue

    if not mlp.gate_up_proj.takes_prologue(h) or mlp.gate_up_proj.weight.shape[0] % 2:
        return None
    return mlp.gate_up_proj(h, epilogue=Epilogue(mlp.act_kind))


def forward(layer, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
            ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """DecoderLayer.forward with the norms and the activation folded into the GEMVs (fusions())."""
    attn, mlp, on = layer.self_attn, layer.mlp, fusions()
    qkv, residual = norm_linear(layer.input_layernorm, attn.qkv_proj, x.contiguous(), residual, "pro_in" in on)
    o_in, post = attn.attend(qkv, positions, ctx), layer.post_attention_layernorm
    fused = linear_add_norm(attn.o_proj, post, o_in, residual) if "epi_post" in on else None
    if fused is not None:
        h, residual = fused
    elif "epi_act" in on:  # the activation epilogue needs the norm's output: the separate add + norm
        h, residual = post(attn.o_proj(o_in), residual)
    else:
        gu, residual = norm_linear(post, mlp.gate_up_proj, attn.o_proj(o_in), residual, "pro_post" in on)
        return act_linear(mlp, gu, "pro_act" in on), residual
    if "epi_act" in on:
        a = linear_act(mlp, h)
        if a is not None:
            return mlp.down_proj(a), residual
    return act_linear(mlp, mlp.gate_up_proj(h), "pro_act" in on), residual
