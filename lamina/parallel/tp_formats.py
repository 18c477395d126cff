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
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lamina.models.weight_formats.base import Partition
from lamina.models.weight_formats.dense import DenseFormat
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
