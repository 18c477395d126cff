"""Which SparseMoE calls take the fused decode kernels (kernels/moe_decode.py): routing in one launch and the
sum over experts folded into the down projection, for at most MAX_TOKENS tokens on CUDA with dense router
and expert weights and softmax top-k routing, or DeepSeek's router where its groups do not bind (greedy;
noaux_tc or group_limited_greedy with topk_group == n_group: DeepSeek-V2-Lite, V3-style configs with one
group), fp32 router weights and logits, routed_scaling_factor and the folded ungated shared experts included.
Everything else (CPU, prefill-sized batches, quantized experts, tensor-parallel router, group-limited routing
whose groups bind, e.g. DeepSeek-V3's 8 groups keep 4) keeps the layer's unfused path.
LAMINA_FUSED_MOE_DECODE=0 switches the fused path off.

Expert parallelism (parallel/expert_parallel.py's EPExperts): only the routing launch is shared; the format
then maps the global ids to its local experts and runs its own per-pair kernels and all-reduce (the folded
down+sum kernel reads experts by global id)."""
from __future__ import annotations

import os

import torch
from torch import nn

from lamina.kernels.dispatch import use_triton
from lamina.kernels.moe_decode import MAX_TOKENS, RouteCounter, moe_decode
from lamina.models.weight_formats import DenseExperts, DenseFormat
from lamina.parallel.expert_parallel import EPExperts

ENV_SWITCH = "LAMINA_FUSED_MOE_DECODE"


def fused_decode(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The routed experts' output (the folded shared expert included) for x [T, H], or None when this call
    is not one the fused path takes. `layer` is a SparseMoE; its `route_counter` holds the kernel's counter."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not use_triton(x) or x.dim() != 2 or \
            not 1 <= x.shape[0] <= MAX_TOKENS:
        return None
    if getattr(layer, "grouped", False):
        return _grouped(layer, x)
    gate, experts = layer.gate, layer.experts
    ep = isinstance(experts.format, EPExperts)
    if type(gate.format) is not DenseFormat or gate.format.partition is not None or gate.bias is not None or \
            not (ep or type(experts.format) is DenseExperts):
        return None
    w13, w2 = experts.gate_up_proj, experts.down_proj
    if not (x.dtype == gate.weight.dtype == w13.dtype == w2.dtype) or gate.weight.stride(-1) != 1 or \
            w13.stride(-1) != 1 or w2.stride(-1) != 1:
        return None
    counter = getattr(layer, "route_counter", None)
    if not isinstance(counter, RouteCounter):
        return None
    if ep:
        cnt = counter.get(x.device)
        if cnt is None:
            return None
        from lamina.kernels.triton_moe_decode import route_triton

        weights, ids = route_triton(x if x.stride(-1) == 1 else x.contiguous(), gate.weight, layer.top_k,
                                    layer.renormalize, layer.shared_fused, cnt)
        return experts(x, weights, ids)
    return moe_decode(x, gate.weight, w13, w2, layer.top_k, layer.renormalize, layer.shared_fused, counter)


def _grouped(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A DeepSeek layer (GroupedTopKRouter) through the fused kernels, where its groups keep every expert."""
    gate = layer.gate
    if not (gate.method == "greedy" or gate.topk_group == gate.n_group):
        return None
    experts = layer.experts
    if type(experts.format) is not DenseExperts:
        return None
    w13, w2 = experts.gate_up_proj, experts.down_proj
    if not (x.dtype == w13.dtype == w2.dtype) or gate.weight.stride(-1) != 1 or w13.stride(-1) != 1 or \
            w2.stride(-1) != 1:
        return None
    counter = getattr(layer, "route_counter", None)
    if not isinstance(counter, RouteCounter):
        return None
    score = "sigmoid" if gate.method == "noaux_tc" else "softmax"
    return moe_decode(x, gate.weight, w13, w2, layer.top_k, gate.renormalize, False, counter, score,
                      gate.e_score_correction_bias, round_logits=False, scale=gate.scaling,
                      fixed=layer.fixed_shared)
