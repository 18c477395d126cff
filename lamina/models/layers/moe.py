"""Sparse MoE feed-forward: router top-k over routed experts, plus an optional shared expert whose output is
scaled by sigmoid(shared_expert_gate(x)) (Qwen3-Next, Qwen3.5-MoE). Names follow HF: mlp.gate (router),
mlp.experts.gate_up_proj / down_proj (stacked), mlp.shared_expert.*, mlp.shared_expert_gate.

DeepSeek-V2/V3 (MoESpec.topk_method set): the router is layers/moe_routing.py's GroupedTopKRouter (fp32,
grouped top-k, routed_scaling_factor) and the shared experts are one ungated MLP, mlp.shared_experts.*, of
n_shared x the routed experts' width; after loading they are folded in as n_shared more routed experts, always
chosen with weight 1 (fuse_shared_expert), so the decode path reads them in the routed experts' launches."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from lamina.kernels.moe import select_experts
from lamina.kernels.moe_decode import RouteCounter, append_fixed
from lamina.models.config import ModelConfig
from lamina.models.layers.linear import Linear
from lamina.models.layers.mlp import GatedMLP
from lamina.models.layers.moe_decode_path import fused_decode
from lamina.models.layers.moe_routing import GroupedTopKRouter
from lamina.models.weight_formats import DenseExperts, DenseFormat, ExpertFormat
from lamina.models.weight_formats.base import clear_params


class FusedExperts(nn.Module):
    """All routed experts' weights, stacked, in the storage of an expert format (dense: gate_up_proj
    [E, 2I, H] and down_proj [E, H, I], as transformers 5 holds them and the MoE kernels read them).

    Checkpoints carry either those stacked tensors or one tensor per expert and projection
    (experts.N.gate_proj/up_proj/down_proj.weight); the latter load as (expert N, shard "gate"/"up") of
    gate_up_proj and (expert N) of down_proj through the format's loaders."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, fmt: ExpertFormat | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.set_format(fmt or DenseExperts(), dtype)

    def set_format(self, fmt: ExpertFormat, dtype: torch.dtype | None = None) -> None:
        """(Re)creates the stacks in `fmt`'s storage; before loading, on the meta device."""
        clear_params(self)
        self.format = fmt
        fmt.create_params(self, self.num_experts, self.hidden, self.intermediate, dtype or torch.get_default_dtype())

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.format.apply(self, x, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, " \
            f"format={self.format!r}"


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.moe
        if m is None:
            raise ValueError("an moe layer needs ModelConfig.moe")
        self.top_k, self.renormalize = m.top_k, m.renormalize
        self.grouped = m.topk_method is not None
        if self.grouped:
            self.gate = GroupedTopKRouter(cfg.hidden_size, m.num_experts, m.top_k, m.topk_method, m.n_group,
                                          m.topk_group, m.renormalize, m.routed_scaling_factor)
        else:
            self.gate = Linear(cfg.hidden_size, m.num_experts, bias=False)
        self.shared_experts: GatedMLP | None = None
        self.fixed_shared = 0  # ungated shared experts folded in as experts E.. (weight 1, always chosen)
        if m.shared_experts_intermediate_size:
            self.shared_experts = GatedMLP(cfg.hidden_size, m.shared_experts_intermediate_size, cfg.hidden_act)
        self.experts = FusedExperts(m.num_experts, cfg.hidden_size, m.intermediate_size)
        self.shared_expert: GatedMLP | None = None
        if m.shared_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, m.shared_intermediate_size, cfg.hidden_act)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.shared_fused = False
        self.route_counter = RouteCounter()  # the fused decode path's routing counter (moe_decode_path)

    @property
    def experts_per_token(self) -> int:
        """Rows of the stacked expert weights one token reads (its top_k, plus a folded-in shared expert)."""
        return self.top_k + int(self.shared_fused) + self.fixed_shared

    @torch.no_grad()
    def fuse_shared_expert(self) -> None:
        """Folds the shared expert into the routed ones, once weights are loaded: it becomes expert E, always
        chosen, with weight sigmoid(its gate), and its gate becomes row E of the router. One router GEMM and
        one grouped-GEMM pair then do what took seven more kernels per layer (the decode step is launch
        bound). Needs the shared expert's width to equal the routed experts' (Qwen3-Next, Qwen3.5-MoE),
        and formats that can hold it (their fold_in / concat_out); otherwise nothing changes."""
        if self.shared_experts is not None:
            self._fold_ungated_shared()
        se = self.shared_expert
        if se is None or self.shared_fused or not self.gate.format.can_concat_out(self.gate, self.shared_expert_gate):
            return
        if not self.experts.format.fold_in(self.experts, se.gate_up_proj, se.down_proj):
            return
        self.gate.format.concat_out(self.gate, self.shared_expert_gate)
        self.shared_expert = None
        del self.shared_expert_gate
        self.shared_fused = True

    @torch.no_grad()
    def _fold_ungated_shared(self) -> None:
        """DeepSeek's shared experts, one SwiGLU of width n x I, are n SwiGLUs of width I (split its
        intermediate dimension): they become experts E.. E+n-1 with weight 1. At decode the MoE block is then
        the fused path's three launches instead of those plus gate|up, SiLU-and-mul, down and the add (the
        batch-1 step is launch bound: ~126 us per layer against ~43 us of bytes on the H200). Dense, unsplit
        weights only (quantized or tensor-parallel shared experts stay as they are)."""
        se, inter = self.shared_experts, self.experts.intermediate
        gu, down = se.gate_up_proj, se.down_proj
        width = down.weight.shape[-1] if down.weight.dim() == 2 else 0
        if type(self.experts.format) is not DenseExperts or width % inter or \
                any(type(getattr(m, "format", None)) is not DenseFormat or m.format.partition is not None or
                    m.bias is not None for m in (gu, down)):
            return
        n = width // inter
        gate, up = gu.weight.split(width)
        for j in range(n):
            rows = slice(j * inter, (j + 1) * inter)
            part_gu = SimpleNamespace(format=gu.format, bias=None, weight=torch.cat([gate[rows], up[rows]]))
            part_down = SimpleNamespace(format=down.format, bias=None, weight=down.weight[:, rows].contiguous())
            if not self.experts.format.fold_in(self.experts, part_gu, part_down):
                if j:
                    raise RuntimeError("folding the shared experts failed half-way")
                return
        self.shared_experts = None
        self.fixed_shared = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A few tokens on CUDA with softmax top-k routing: routing + experts + sum in three launches.
        out = fused_decode(self, x)
        if out is None:
            if self.grouped:
                weights, ids = append_fixed(*self.gate(x), self.experts.num_experts - self.fixed_shared,
                                            self.fixed_shared)
            else:
                weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize, self.shared_fused)
            out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
