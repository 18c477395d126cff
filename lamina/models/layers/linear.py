"""Linear layers whose weight is several checkpoint tensors stacked (q|k|v, gate|up): one matmul instead of
several, which matters most for small-batch decode where each launch is memory-bound."""
from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """An nn.Linear whose output rows are the concatenation of named shards."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_slices: dict[str, slice] = {}
        start = 0
        for name, size in shards.items():
            self.shard_slices[name] = slice(start, start + size)
            start += size

    def load_shard(self, param: str, shard: str, tensor: torch.Tensor) -> None:
        target = getattr(self, param)
        rows = self.shard_slices[shard]
        if tensor.shape[0] != rows.stop - rows.start:
            raise ValueError(f"shard {shard!r} of {param}: expected {rows.stop - rows.start} rows, got {tensor.shape[0]}")
        with torch.no_grad():
            target[rows].copy_(tensor)
