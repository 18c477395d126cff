"""Sparse MoE feed-forward: router top-k over routed experts, plus an optional shared expert whose output is
scaled by sigmoid(shared_expert_gate(x)) (Qwen3-Next, Qwen3.5-MoE). Names follow HF: mlp.gate (router),
mlp.experts.gate_up_proj / down_proj (stacked), mlp.shared_expert.*, mlp.shared_expert_gate."""
from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.moe import fused_moe, select_experts
from lamina.models.config import ModelConfig
from lamina.models.layers.mlp import GatedMLP


class FusedExperts(nn.Module):
    """All experts' weights stacked as transformers 5 holds them: gate_up_proj [E, 2I, H], down_proj [E, H, I].

    Checkpoints carry either these stacked tensors or one tensor per expert and projection
    (experts.N.gate_proj/up_proj/down_proj.weight); the loader puts the latter in as shards "N.gate",
    "N.up" and "N".
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def expected_shards(self, param: str) -> list[str]:
        if param == "gate_up_proj":
            return [f"{e}.{p}" for e in range(self.num_experts) for p in ("gate", "up")]
        return [str(e) for e in range(self.num_experts)]

    def load_shard(self, param: str, shard: str, tensor: torch.Tensor) -> None:
        expert, _, part = shard.partition(".")
        e = int(expert)
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert {e} out of range (the config has {self.num_experts})")
        target = getattr(self, param)[e]
        if part:
            i = self.intermediate
            target = target[:i] if part == "gate" else target[i:]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {shard} of {param}: expected {tuple(target.shape)}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            target.copy_(tensor)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.moe
        if m is None:
            raise ValueError("an moe layer needs ModelConfig.moe")
        self.top_k, self.renormalize = m.top_k, m.renormalize
        self.gate = nn.Linear(cfg.hidden_size, m.num_experts, bias=False)
        self.experts = FusedExperts(m.num_experts, cfg.hidden_size, m.intermediate_size)
        self.shared_expert: GatedMLP | None = None
        if m.shared_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, m.shared_intermediate_size, cfg.hidden_act)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.shared_fused = False

    @property
    def experts_per_token(self) -> int:
        """Rows of the stacked expert weights one token reads (its top_k, plus a folded-in shared expert)."""
        return self.top_k + int(self.shared_fused)

    @torch.no_grad()
    def fuse_shared_expert(self) -> None:
        """Folds the shared expert into the routed ones, once weights are loaded: it becomes expert E, always
        chosen, with weight sigmoid(its gate), and its gate becomes row E of the router. One router GEMM and
        one grouped-GEMM pair then do what took seven more kernels per layer (the decode step is launch
        bound). Needs the shared expert's width to equal the routed experts' (Qwen3-Next, Qwen3.5-MoE)."""
        se, ex = self.shared_expert, self.experts
        if se is None or self.shared_fused or se.down_proj.weight.shape[1] != ex.intermediate:
            return
        ex.gate_up_proj = nn.Parameter(torch.cat([ex.gate_up_proj, se.gate_up_proj.weight[None]]),
                                       requires_grad=False)
        ex.down_proj = nn.Parameter(torch.cat([ex.down_proj, se.down_proj.weight[None]]), requires_grad=False)
        ex.num_experts += 1
        self.gate.weight = nn.Parameter(torch.cat([self.gate.weight, self.shared_expert_gate.weight]),
                                        requires_grad=False)
        self.shared_expert = None
        del self.shared_expert_gate
        self.shared_fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize, self.shared_fused)
        out = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
