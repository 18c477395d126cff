"""Which SparseMoE calls take the fused decode kernels (kernels/moe_decode.py): routing in one launch and the
sum over experts folded into the down projection, for at most MAX_TOKENS tokens on CUDA with dense router
and expert weights and softmax top-k routing, or DeepSeek's router (GroupedTopKRouter: fp32 router weights
and logits, routed_scaling_factor, the folded ungated shared experts; group-limited choice in the kernel
where the experts and groups are powers of two, e.g. V3's 256 experts in 8 groups keep 4). Everything else
(CPU, prefill-sized batches, quantized experts, tensor-parallel router, binding groups over 160 experts as
DeepSeek-V2's) keeps the layer's unfused path.
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
    """A DeepSeek layer (GroupedTopKRouter) through the fused kernels."""
    gate = layer.gate
    binding = gate.method != "greedy" and gate.topk_group < gate.n_group
    e = gate.weight.shape[0] if binding else 0
    if binding and (e & (e - 1) or gate.n_group & (gate.n_group - 1)):  # the kernel's groups: powers of two
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
                      fixed=layer.fixed_shared, n_group=gate.n_group if binding else 1, topk_group=gate.topk_group,
                      group_top2=gate.method == "noaux_tc")
