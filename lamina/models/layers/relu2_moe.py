"""Nemotron-H's MoE block: grouped sigmoid routing with a score-correction bias, ungated (relu2) routed experts,
optional latent projections around them, and an always-on ungated shared expert.

The math and rounding follow HF's NemotronHMoE: router logits in fp32 from an fp32 router weight (kept fp32
whatever the model dtype), each expert's output in the model dtype times its fp32 routing weight, accumulated
in fp32 in ascending expert order, cast back, then the shared expert added.

Names as the HF checkpoint's (the family maps mixer -> mlp): gate.weight [E, H] and gate.e_score_correction_bias
[E] (fp32), experts.up_proj [E, I, H'] and experts.down_proj [E, H', I] (stacked; per-expert checkpoint
tensors load as expert parts), fc1_latent_proj / fc2_latent_proj (H' = latent size) when the config has them,
shared_experts.up_proj / down_proj.
"""
from __future__ import annotations

import torch
from torch import nn

from lamina.models.config import ModelConfig
from lamina.models.layers.linear import Linear
from lamina.models.layers.single_block import PLAIN_ACTS, PlainMLP
from lamina.models.weight_formats.base import copy_checked, register_param


def grouped_sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                         renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, top_k] fp32, expert ids [T, top_k]).

    Experts are chosen by sigmoid(logits) + bias among the topk_group groups whose two best biased scores sum
    highest; the weights are the chosen unbiased scores (renormalized to sum 1 if asked), times scale."""
    t, e = logits.shape
    scores = logits.sigmoid()
    choice = scores + bias.float()
    groups = choice.view(t, n_group, e // n_group)
    group_scores = groups.topk(min(2, e // n_group), dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class Fp32Router(nn.Module):
    """The router's weight and correction bias, kept fp32 when the model is cast to its dtype (as HF keeps
    them: routing near-ties must not flip with bf16 rounding)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for p in self._parameters.values():
            if p is not None and p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight)


def _stack_loader(layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                  expert: int | None = None) -> None:
    if shard is not None:
        raise ValueError(f"an expert stack has no shard {shard!r}")
    copy_checked(param if expert is None else param[expert], tensor, "the expert stack")


class Relu2Experts(nn.Module):
    """Stacked ungated experts: down_proj[e] @ act(up_proj[e] @ x)."""

    def __init__(self, num_experts: int, dim: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.num_experts, self.act = num_experts, PLAIN_ACTS[act]
        parts = tuple(str(e) for e in range(num_experts))
        register_param(self, "up_proj", nn.Parameter(torch.empty(num_experts, intermediate, dim)), _stack_loader,
                       parts)
        register_param(self, "down_proj", nn.Parameter(torch.empty(num_experts, dim, intermediate)), _stack_loader,
                       parts)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.act(torch.nn.functional.linear(x, self.up_proj[e])), self.down_proj[e])

    def dense_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """What a CUDA graph captures (it cannot size per-expert batches from device data): every expert on
        every row, weighted by the row's weight for it (0 where not chosen). Same sums, E / top_k the work."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            out += self._expert(e, x) * (weights * (ids == e)).sum(-1, keepdim=True)
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H'], weights / ids [T, top_k] -> [T, H'] in x's dtype: each expert on its rows only (eager)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.dense_forward(x, weights, ids)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per layer
        start = 0
        for e, n in enumerate(counts):
            if n:
                pick = order[start:start + n]
                rows = pick // k
                y = self._expert(e, x.index_select(0, rows)) * weights.flatten()[pick][:, None]
                out.index_add_(0, rows, y)
            start += n
        return out.to(x.dtype)


class Relu2MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.relu2_moe
        if m is None:
            raise ValueError("a relu2_moe layer needs ModelConfig.relu2_moe")
        if m.num_experts % m.n_group or m.topk_group > m.n_group:
            raise ValueError(f"MoE routing: {m.num_experts} experts in {m.n_group} groups, topk_group {m.topk_group}")
        self.spec = m
        dim = m.latent_size or cfg.hidden_size
        self.gate = Fp32Router(m.num_experts, cfg.hidden_size)
        self.experts = Relu2Experts(m.num_experts, dim, m.intermediate_size, cfg.hidden_act)
        if m.latent_size:
            self.fc1_latent_proj = Linear(cfg.hidden_size, m.latent_size)
            self.fc2_latent_proj = Linear(m.latent_size, cfg.hidden_size)
        self.shared_experts = PlainMLP(cfg.hidden_size, m.shared_intermediate_size, cfg.hidden_act)

    @property
    def experts_per_token(self) -> int:
        """Rows of the stacked expert weights one token reads (benchmarks' bytes per token)."""
        return self.spec.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.spec
        weights, ids = grouped_sigmoid_topk(self.gate(x), self.gate.e_score_correction_bias, m.top_k, m.n_group,
                                            m.topk_group, m.norm_topk_prob, m.routed_scaling_factor)
        h = self.fc1_latent_proj(x) if m.latent_size else x
        h = self.experts(h, weights, ids)
        if m.latent_size:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)
