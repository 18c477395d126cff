"""Tensor-parallel weight formats: dense storage of this rank's slice, plus the collective its layer needs.

They are DenseFormat with a Partition (which already creates only the local slice and cuts it out of each
full checkpoint tensor as it loads), and they own the communication, so the layers using them stay as they
are:

- ColumnParallel (dim 0): each rank computes its out/world features; a fused projection splits each part on
  its own, so a rank holds [q_r | k_r | v_r] and the layer's own split of the output still works on local
  sizes. `shard_partitions` splits some parts into fewer pieces (k and v when KV heads are fewer than ranks:
  each rank holds the one KV head its query heads use). gather=True: the output is all-gathered (lm_head:
  every rank ends with the full vocabulary's logits). As an embedding table it is vocab-parallel: each rank
  looks up the ids in its rows, zeros the others, and the ranks' rows are summed.
- RowParallel (dim 1): each rank multiplies its in/world input columns (the local heads' attention output,
  the local intermediate features) and the partial sums are all-reduced; rank 0 alone adds the bias.
- TPExperts: a MoE layer's routed experts, each split along its intermediate dim like a dense MLP.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lamina.models.weight_formats.base import Partition, copy_checked
from lamina.models.weight_formats.dense import DenseExperts, DenseFormat
from lamina.parallel.context import ParallelContext


class ColumnParallel(DenseFormat):
    def __init__(self, ctx: ParallelContext, shard_partitions: Mapping[str, Partition] | None = None,
                 gather: bool = False) -> None:
        super().__init__(Partition(ctx.rank, ctx.world, 0), shard_partitions)
        self.ctx, self.gather = ctx, gather

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, layer.weight, layer.bias)
        return self.ctx.gather_last(y) if self.gather else y

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = layer.weight.shape[0]
        local = ids - self.ctx.rank * rows
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), layer.weight)
        return self.ctx.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def tie(self, layer: nn.Module, source: nn.Module) -> None:
        """lm_head reads the embedding's rows: both are split the same way over the vocabulary."""
        f = getattr(source, "format", None)
        if not isinstance(f, ColumnParallel) or f.partition != self.partition or layer.bias is not None or \
                source.weight.shape != layer.weight.shape or source.weight.dtype != layer.weight.dtype:
            raise ValueError(f"cannot tie a vocab-parallel lm_head {tuple(layer.weight.shape)} to {f!r}")
        layer.weight = source.weight

    def can_concat_out(self, layer: nn.Module, other: nn.Module) -> bool:
        return False


class RowParallel(DenseFormat):
    def __init__(self, ctx: ParallelContext) -> None:
        super().__init__(Partition(ctx.rank, ctx.world, 1))
        self.ctx = ctx

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(super().apply(layer, x))

    def can_concat_out(self, layer: nn.Module, other: nn.Module) -> bool:
        return False


class TPExperts(DenseExperts):
    """Every routed expert split along its intermediate dim (tensor parallelism for MoE): a rank holds gate and
    up rows [r*I/w, (r+1)*I/w) and the same down columns of every expert, computes its partial expert outputs
    with the usual grouped kernels, and the partial sums are all-reduced. Routing is replicated (the router's
    weights are whole on every rank), so every rank picks the same experts for every token."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.part = Partition(ctx.rank, ctx.world, 0)

    def __repr__(self) -> str:
        return f"TPExperts(rank={self.ctx.rank}, world={self.ctx.world})"

    def create_params(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                      dtype: torch.dtype) -> None:
        super().create_params(layer, num_experts, hidden, self.part.local(intermediate), dtype)

    def _rows(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's gate rows then up rows of a full [.., 2I, ..] gate|up tensor, along `dim`."""
        gate, up = tensor.chunk(2, dim=dim)
        return torch.cat([self.part.take(gate, dim), self.part.take(up, dim)], dim=dim)

    def _load_gate_up(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                      expert: int | None = None) -> None:
        if expert is None:
            if shard is not None:
                raise ValueError(f"shard {shard!r} of the stacked experts needs an expert index")
            _full(tensor, (layer.num_experts, 2 * layer.intermediate, layer.hidden), "the stacked gate|up experts")
            copy_checked(param, self._rows(tensor, 1), "the stacked gate|up experts")
            return
        target = self._slot(layer, param, expert)
        i = target.shape[0] // 2
        if shard is None:
            _full(tensor, (2 * layer.intermediate, layer.hidden), f"expert {expert}'s gate|up")
            copy_checked(target, self._rows(tensor, 0), f"expert {expert}'s gate|up")
            return
        if shard not in ("gate", "up"):
            raise ValueError(f"expert {expert} has no shard {shard!r} (its shards: gate, up)")
        _full(tensor, (layer.intermediate, layer.hidden), f"expert {expert}'s {shard}")
        rows = target[:i] if shard == "gate" else target[i:]
        copy_checked(rows, self.part.take(tensor, 0), f"expert {expert}'s {shard}")

    def _load_down(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                   expert: int | None = None) -> None:
        if shard is not None:
            raise ValueError(f"the down projection has no shard {shard!r}")
        if expert is None:
            _full(tensor, (layer.num_experts, layer.hidden, layer.intermediate), "the stacked down experts")
            copy_checked(param, self.part.take(tensor, 2), "the stacked down experts")
        else:
            _full(tensor, (layer.hidden, layer.intermediate), f"expert {expert}'s down")
            copy_checked(self._slot(layer, param, expert), self.part.take(tensor, 1), f"expert {expert}'s down")

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(super().apply(layer, x, topk_weights, topk_ids))

    def fold_in(self, layer: nn.Module, gate_up: nn.Module, down: nn.Module) -> bool:
        return False  # a shared expert stays a (tensor-parallel) MLP of its own


def _full(tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """Shape check against the full checkpoint tensor, so errors name the checkpoint's own sizes."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{what} expects shape {shape}, the checkpoint has {tuple(tensor.shape)}")
