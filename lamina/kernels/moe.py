"""Sparse mixture of experts: top-k routing, then each expert's SwiGLU over the tokens routed to it.

Expert weights are stacked the way transformers 5 holds them: w13 [E, 2I, H] (gate rows then up rows) and
w2 [E, H, I]. The reference groups tokens by expert (one gather, two matmuls and a scatter-add per expert
that has tokens), which is also the shape of the fused GPU kernels (sort by expert, grouped GEMM).

Expert id E (one past the stack) marks a (token, slot) pair whose expert lives on another expert-parallel
rank (lamina/parallel/expert_parallel.py): it contributes zero here, and no kernel reads weights for it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.dispatch import use_triton


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, top-k, optional renormalization (norm_topk_prob), like HF's TopKRouter.

    shared: the last logit column is a shared expert's gate (folded in as the last expert, see
    SparseMoE.fuse_shared_expert): it is appended to every token's choice with weight sigmoid(logit).
    Returns (weights [T, k(+1)] in the logits' dtype, expert ids [T, k(+1)] int64)."""
    if use_triton(router_logits):
        from lamina.kernels.triton_moe import select_experts_triton

        return select_experts_triton(router_logits, top_k, renormalize, shared)
    routed = router_logits[:, :-1] if shared else router_logits
    probs = torch.softmax(routed, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if shared:
        weights = torch.cat([weights, torch.sigmoid(router_logits[:, -1:].float())], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], routed.shape[1])], dim=1)
    return weights.to(router_logits.dtype), ids


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x: [T, H] -> [T, H] = sum over a token's k experts of weight * down(silu(gate(x)) * up(x))."""
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert, in token order
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()[:w13.shape[0]]  # id E: a remote pair
    token_of = order // topk_ids.shape[1]
    weight_of = topk_weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start:start + n]
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weight_of[start:start + n, None]
        out.index_add_(0, tok, y.to(out.dtype))
        start += n
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, remote_pairs: bool = False) -> torch.Tensor:
    """remote_pairs: some ids may be E (experts on other ranks; those pairs add nothing). Without it every id
    must be < E (the GPU path then skips zeroing the rows of pairs it never computes)."""
    if use_triton(x):
        from lamina.kernels.triton_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, remote_pairs=remote_pairs)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
