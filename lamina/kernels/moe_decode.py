"""MoE decode path for a handful of tokens: router -> scores -> top-k -> renormalize in one launch, gate|up per
(token, slot) pair, and the down projection with the weighted sum over a token's experts folded in
(triton_moe_decode.py). The references below are the CPU path and the oracle; they compute exactly what
select_experts + fused_moe_ref compute (router logits rounded to x's dtype, fp32 scores), so the fused path
routes the same way as the unfused one.

Dispatch: `moe_decode` runs the Triton path for CUDA tensors with T <= MAX_TOKENS, else the references.
`RouteCounter` owns the routing kernel's arrival counter (one per MoE layer; see triton_moe_decode).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.dispatch import use_triton

MAX_TOKENS = 16  # = triton_moe_decode.MAX_TOKENS (not imported: that module needs triton)


def route_ref(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool, shared: bool,
              score: str = "softmax", bias: torch.Tensor | None = None, *, round_logits: bool = True,
              scale: float = 1.0, fixed: int = 0, n_group: int = 1, topk_group: int = 1,
              group_top2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], gate_weight [E (+1), H] -> (weights [T, k(+1 or +fixed)] in x's dtype, ids int64).

    score "softmax" (Qwen MoE) or "sigmoid" (per-expert scores; `bias` [E], if given, shifts the selection
    only, as DeepSeek-V3's score correction does; weights stay the unshifted scores). renormalize: the chosen
    weights sum to 1 (norm_topk_prob). shared: the last router row is a folded shared expert's gate, appended
    to every token's choice as expert E with weight sigmoid(its logit).
    DeepSeek (GroupedTopKRouter without groups that bind): round_logits=False keeps the fp32 logits of an fp32
    router (gate_weight may be fp32 while x is not), scale is routed_scaling_factor (after renormalizing),
    and `fixed` ungated shared experts folded in as experts E.. E+fixed-1 follow with weight 1.
    n_group > 1: only the topk_group best groups of E / n_group experts compete, a group scored by its best
    selection score or (group_top2, DeepSeek-V3) the sum of its best two (layers/moe_routing.py's rule)."""
    assert not (shared and fixed)
    logits = F.linear(x, gate_weight) if round_logits else F.linear(x.float(), gate_weight.float())
    routed = logits[:, :-1] if shared else logits
    if score == "softmax":
        probs = torch.softmax(routed, dim=-1, dtype=torch.float32)
    elif score == "sigmoid":
        probs = torch.sigmoid(routed.float())
    else:
        raise ValueError(f"unknown routing score {score!r}")
    sel = probs + bias.float() if bias is not None else probs
    if n_group > 1 and topk_group < n_group:
        g = sel.view(sel.shape[0], n_group, -1)
        gs = g.topk(min(2, g.shape[-1]), dim=-1)[0].sum(-1) if group_top2 else g.amax(-1)
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(topk_group, dim=-1)[1], True)
        sel = sel.masked_fill(~keep.repeat_interleave(g.shape[-1], dim=1), float("-inf"))
    ids = torch.topk(sel, top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * scale
    if shared:
        weights = torch.cat([weights, torch.sigmoid(logits[:, -1:].float())], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], routed.shape[1])], dim=1)
    return append_fixed(weights.to(x.dtype), ids, routed.shape[1], fixed)


def append_fixed(weights: torch.Tensor, ids: torch.Tensor, first: int, fixed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [T, k] with `fixed` always-chosen experts first.. first+fixed-1 of weight 1 appended."""
    if not fixed:
        return weights, ids
    extra = torch.arange(first, first + fixed, dtype=ids.dtype, device=ids.device).expand(ids.shape[0], fixed)
    return torch.cat([weights, weights.new_ones(weights.shape[0], fixed)], 1), torch.cat([ids, extra], 1)


def gate_up_pairs_ref(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """inter [T*S, I]: silu(gate) * up of token t through expert ids[t, s], row t*S + s, in x's dtype."""
    s = ids.shape[1]
    xs = x.repeat_interleave(s, dim=0)
    gu = torch.bmm(w13[ids.reshape(-1)].float(), xs.float()[:, :, None])[:, :, 0]
    gate, up = gu.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def down_sum_ref(inter: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """out [T, H] = sum_s weights[t, s] * (w2[ids[t, s]] @ inter[t*S + s]), accumulated in fp32, in inter's
    dtype."""
    t, s = ids.shape
    y = torch.bmm(w2[ids.reshape(-1)].float(), inter.float()[:, :, None])[:, :, 0]  # [T*S, H]
    return (y.view(t, s, -1) * weights.float()[:, :, None]).sum(dim=1).to(inter.dtype)


def moe_decode_ref(x: torch.Tensor, gate_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                   renormalize: bool, shared: bool, score: str = "softmax",
                   bias: torch.Tensor | None = None, **routing) -> torch.Tensor:
    weights, ids = route_ref(x, gate_weight, top_k, renormalize, shared, score, bias, **routing)
    return down_sum_ref(gate_up_pairs_ref(x, w13, ids), w2, weights, ids)


class RouteCounter:
    """The routing kernel's arrival counter for one layer, allocated on first use on the layer's device.
    `get` returns None while a CUDA graph is being captured and nothing was allocated yet (the caller then
    takes the unfused path; engine warm-up runs eager steps first, so capture normally finds it)."""

    def __init__(self) -> None:
        self._counter: torch.Tensor | None = None

    def get(self, device: torch.device) -> torch.Tensor | None:
        if self._counter is None or self._counter.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            from lamina.kernels.triton_moe_decode import new_route_counter

            self._counter = new_route_counter(device)
        return self._counter


def moe_decode(x: torch.Tensor, gate_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               renormalize: bool, shared: bool, counter: RouteCounter, score: str = "softmax",
               bias: torch.Tensor | None = None, **routing) -> torch.Tensor | None:
    """The routed (+ folded shared) experts' output for x [T, H], or None where the caller should take its
    unfused path (more than MAX_TOKENS tokens on CUDA, or no counter during a graph capture).
    routing: route_ref's keywords (round_logits, scale, fixed)."""
    if not use_triton(x):
        return moe_decode_ref(x, gate_weight, w13, w2, top_k, renormalize, shared, score, bias, **routing)
    if not 1 <= x.shape[0] <= MAX_TOKENS:
        return None
    cnt = counter.get(x.device)
    if cnt is None:
        return None
    from lamina.kernels.triton_moe_decode import moe_decode_triton

    return moe_decode_triton(x, gate_weight, w13, w2, top_k, renormalize, shared, cnt, score, bias, **routing)
