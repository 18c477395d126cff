"""Triton MoE router: softmax over the experts' logits and the top-k of each token in one program per token
(the reference is lamina.kernels.moe's select_experts; ties go to the lowest expert index)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_softmax_kernel(logits_ptr, w_ptr, id_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr,
                         SHARED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < num_experts
    x = tl.load(logits_ptr + row * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.where(ok, tl.exp(x - tl.max(x, 0)), 0.0)
    probs = p / tl.sum(p, 0)
    cur = tl.where(ok, probs, -1.0)  # taken and padding lanes become -1 (probabilities are >= 0)
    slot = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        v = tl.max(cur, 0)
        idx = tl.min(tl.where(cur == v, e, BLOCK_E), 0)  # lowest index among ties
        w = tl.where(slot == i, v, w)
        ids = tl.where(slot == i, idx, ids)
        cur = tl.where(e == idx, -1.0, cur)
    if RENORM:
        w = w / tl.sum(tl.where(slot < TOP_K, w, 0.0), 0)
    width = TOP_K + SHARED
    tl.store(w_ptr + row * width + slot, w.to(w_ptr.dtype.element_ty), mask=slot < TOP_K)
    tl.store(id_ptr + row * width + slot, ids.to(tl.int64), mask=slot < TOP_K)
    if SHARED:  # the shared expert, folded in as expert `num_experts`, always taken with sigmoid(its logit)
        s = tl.load(logits_ptr + row * stride_l + num_experts).to(tl.float32)
        tl.store(w_ptr + row * width + TOP_K, tl.sigmoid(s).to(w_ptr.dtype.element_ty))
        tl.store(id_ptr + row * width + TOP_K, num_experts.to(tl.int64))


def select_experts_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, shared: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in the logits' dtype, ids [T, k] int64), like select_experts
    (shared: the last logit column is the shared expert's gate; it becomes column k, expert id E - 1)."""
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    t, e = logits.shape
    e -= int(shared)
    weights = torch.empty(t, top_k + int(shared), dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k + int(shared), dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    _topk_softmax_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k, BLOCK_E=block_e,
                               BLOCK_K=triton.next_power_of_2(top_k), RENORM=bool(renormalize), SHARED=bool(shared),
                               num_warps=4 if block_e >= 512 else 1)
    return weights, ids
