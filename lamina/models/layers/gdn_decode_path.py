"""Which GatedDeltaNet calls take the decode fusions:
- the gated norm inside the out_proj GEMV (kernels/norm_gated.rms_norm_gated_linear): at most 16 tokens on
  CUDA with a dense, unpartitioned, bias-free out_proj (LAMINA_FUSED_GDN_OUT=0 switches it off);
- the conv update inside the recurrent decode step (kernels/triton_gdn_conv_decode.py): decode-only steps
  (one token per sequence, no speculative verify) on CUDA (LAMINA_FUSED_GDN_CONV=0 switches it off).
Everything else keeps the separate ops."""
from __future__ import annotations

import os

import torch
from torch import nn

from lamina.kernels.dispatch import use_triton
from lamina.kernels.gdn_conv_decode import ConvCounters
from lamina.kernels.metadata import StepContext
from lamina.kernels.norm_gated import MAX_FUSED_TOKENS, rms_norm_gated_linear
from lamina.models.weight_formats import DenseFormat

ENV_SWITCH = "LAMINA_FUSED_GDN_OUT"
CONV_SWITCH = "LAMINA_FUSED_GDN_CONV"


def fused_norm_out_proj(layer: nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor | None:
    """out_proj(norm(core, z)) for core, z [T, Hv, dv], or None when this call is not one the fusion takes.
    `layer` is a GatedDeltaNet (its `norm` and `out_proj`)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not use_triton(core) or not 1 <= core.shape[0] <= MAX_FUSED_TOKENS:
        return None
    proj = layer.out_proj
    if type(proj.format) is not DenseFormat or proj.format.partition is not None or proj.bias is not None:
        return None
    return rms_norm_gated_linear(core, z, layer.norm.weight, layer.norm.eps, proj.weight)


def fused_conv_recurrent(layer: nn.Module, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         ctx: StepContext) -> torch.Tensor | None:
    """core [T, Hv, dv] from the raw qkv rows of a decode-only step, conv and recurrent states updated; None
    when this step is not one the fusion takes. `layer` is a GatedDeltaNet (its conv weights, gates, pools and
    `conv_counters`)."""
    st = ctx.state
    if os.environ.get(CONV_SWITCH, "1") == "0" or not use_triton(qkv) or ctx.attn.max_query_len != 1 or \
            (st is not None and (st.candidate_slots is not None or st.candidate_slots_cpu is not None)) or \
            qkv.stride(-1) != 1 or a.stride(-1) != 1 or \
            b.stride(-1) != 1 or layer.conv_kernel < 2:
        return None
    counters = getattr(layer, "conv_counters", None)
    if not isinstance(counters, ConvCounters):
        return None
    cnt = counters.get(qkv.shape[0], layer.num_k_heads, qkv.device)
    if cnt is None:
        return None
    conv_states, ssm_states = (layer.conv_state, layer.ssm_state) if st is not None else (None, None)
    from lamina.kernels.triton_gdn_conv_decode import gdn_conv_decode_triton

    weight = layer.conv1d.weight.squeeze(1)
    if weight.stride(-1) != 1:
        return None
    return gdn_conv_decode_triton(qkv, weight, layer.conv1d.bias, conv_states, a, b, layer.A_log, layer.dt_bias,
                                  ssm_states, st.slots if st is not None else None,
                                  st.has_initial_state if st is not None else None, cnt, layer.num_k_heads,
                                  layer.head_k_dim, layer.num_v_heads, layer.head_v_dim)
