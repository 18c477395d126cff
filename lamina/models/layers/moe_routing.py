"""DeepSeek's MoE routers: fp32 router logits, softmax or sigmoid scores, optional group-limited top-k,
routed_scaling_factor. Kept apart from SparseMoE so a fused routing kernel can replace `grouped_topk` alone.

Methods (HF transformers 5.24's DeepseekV2TopkRouter / DeepseekV3TopkRouter):
  - "greedy" (DeepSeek-V2): softmax scores, plain top-k.
  - "group_limited_greedy" (DeepSeek-V2): softmax; the experts fall into n_group groups, a group's score is
    its best expert's, only the topk_group best groups compete (the others' scores become 0).
  - "noaux_tc" (DeepSeek-V3): sigmoid scores; e_score_correction_bias is added for the choice only (the
    weights are the uncorrected scores); a group's score is the sum of its two best corrected scores; the
    losing groups' experts are masked to -inf.
Then the chosen weights are optionally renormalized (V3's norm_topk_prob; HF's V2 router never does) and
multiplied by routed_scaling_factor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def grouped_topk(logits: torch.Tensor, top_k: int, method: str, n_group: int = 1, topk_group: int = 1,
                 renormalize: bool = False, scaling: float = 1.0,
                 correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] fp32 router logits -> (weights [T, top_k] fp32, expert ids [T, top_k] int64)."""
    if method not in METHODS:
        raise ValueError(f"unsupported MoE top-k method {method!r}; lamina supports {', '.join(METHODS)}")
    t, e = logits.shape
    if method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        groups = choice.view(t, n_group, e // n_group).topk(min(2, e // n_group), dim=-1)[0].sum(dim=-1)
        choice = _keep_groups(choice, groups, topk_group, float("-inf"))
        ids = torch.topk(choice, top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if method == "group_limited_greedy":
            groups = scores.view(t, n_group, e // n_group).max(dim=-1).values
            scores = _keep_groups(scores, groups, topk_group, 0.0)
        weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def _keep_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """scores with the experts outside the topk_group best groups set to `fill`."""
    t, n_group = group_scores.shape
    best = torch.topk(group_scores, topk_group, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep[:, :, None].expand(t, n_group, scores.shape[1] // n_group).reshape(t, -1)
    return scores.masked_fill(~keep, fill)


class GroupedTopKRouter(nn.Module):
    """mlp.gate of DeepSeek-V2/V3: weight [E, H] and (noaux_tc) e_score_correction_bias [E], both kept in fp32
    whatever the model dtype (HF keeps them fp32 too: routing decisions are sensitive to rounding)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, method: str, n_group: int, topk_group: int,
                 renormalize: bool, scaling: float) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"unsupported MoE top-k method {method!r}; lamina supports {', '.join(METHODS)}")
        if method != "greedy" and (n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group):
            raise ValueError(f"n_group {n_group} must divide {num_experts} experts and topk_group {topk_group} "
                             f"must be in [1, n_group]")
        self.top_k, self.method, self.n_group, self.topk_group = top_k, method, n_group, topk_group
        self.renormalize, self.scaling = renormalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False) if method == "noaux_tc" else None

    def _apply(self, fn, recurse=True):
        """Module.to(dtype) would cast the router to the model dtype: cast it back (on the meta device, before
        any storage exists, this only fixes the dtype the storage is later allocated in)."""
        super()._apply(fn, recurse)
        for name, p in list(self._parameters.items()):
            if p is not None and p.dtype != torch.float32:
                self._parameters[name] = nn.Parameter(p.float(), requires_grad=False)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, top_k] in x's dtype, ids [T, top_k] int64)."""
        logits = F.linear(x.float(), self.weight)
        weights, ids = grouped_topk(logits, self.top_k, self.method, self.n_group, self.topk_group,
                                    self.renormalize, self.scaling, self.e_score_correction_bias)
        return weights.to(x.dtype), ids
