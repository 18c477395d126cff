"""Dense weights (bf16 / fp16 / fp32, the model's dtype): the format every layer gets unless told otherwise.

Linear-shaped layers hold `weight` [out, in] (+ `bias` [out]) exactly as nn.Linear did, applied with
F.linear; the expert stack holds `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], the layout the MoE
kernels (reference and Triton) read. Only the loading differs from a plain copy: fused shards land in their
rows, experts in their slot, and a Partition cuts this rank's slice out of the full checkpoint tensor.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lamina.kernels.moe import fused_moe
from lamina.models.weight_formats.base import (
    ExpertFormat,
    Partition,
    WeightFormat,
    copy_checked,
    new_param,
    register_param,
)


def _check_full(tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """Shape check against the full (unpartitioned) tensor, so errors name the checkpoint's own sizes."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{what} expects shape {shape}, the checkpoint has {tuple(tensor.shape)}")


class DenseFormat(WeightFormat):
    """weight [out, in] in the model dtype; `partition`: this tensor-parallel rank's slice (None: whole).

    Needs the layer's `in_features` and `out_shards` (full sizes, set by the layer before create_params)."""

    def __init__(self, partition: Partition | None = None,
                 shard_partitions: Mapping[str, Partition] | None = None) -> None:
        self.partition = partition
        # Fused parts split differently from the rest (KV heads replicated when fewer than ranks: k and v
        # split into num_kv_heads pieces, q into world).
        self.shard_partitions = dict(shard_partitions or {})
        # Row-parallel outputs are partial sums that get all-reduced: rank 0 alone adds the bias.
        self._skip_bias = partition is not None and partition.dim == 1 and partition.rank != 0

    def __repr__(self) -> str:
        extra = f", shard_partitions={self.shard_partitions}" if self.shard_partitions else ""
        return f"{type(self).__name__}(partition={self.partition}{extra})"

    # -- shapes -----------------------------------------------------------------------------------------
    def _part(self, shard: str | None) -> Partition | None:
        return self.shard_partitions.get(shard or "", self.partition)

    def _local_out(self, size: int, shard: str = "") -> int:
        p = self._part(shard)
        return p.local(size) if p is not None and p.dim == 0 else size

    def _local_in(self, size: int) -> int:
        p = self.partition
        return p.local(size) if p is not None and p.dim == 1 else size

    def _rows(self, layer: nn.Module, shard: str) -> slice:
        """The local rows of fused part `shard`."""
        start = 0
        for name, size in layer.out_shards.items():
            n = self._local_out(size, name)
            if name == shard:
                return slice(start, start + n)
            start += n
        named = [n for n in layer.out_shards if n]
        raise ValueError(f"no shard {shard!r}" + (f" (its shards: {', '.join(named)})" if named else
                                                         " (it is not a fused projection)"))

    def create_params(self, layer: nn.Module, in_features: int, out_shards: Mapping[str, int], bias: bool,
                      dtype: torch.dtype) -> None:
        out = sum(self._local_out(s, n) for n, s in out_shards.items())
        parts = tuple(n for n in out_shards if n)
        register_param(layer, "weight", new_param((out, self._local_in(in_features)), dtype), self._load_weight,
                       parts)
        if bias:
            register_param(layer, "bias", new_param((out,), dtype), self._load_bias, parts)
        else:
            layer.register_parameter("bias", None)

    # -- loading ----------------------------------------------------------------------------------------
    def _load(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None,
              expert: int | None, is_bias: bool) -> None:
        kind = "bias" if is_bias else "weight"
        if expert is not None:
            raise ValueError(f"this {kind} is not an expert stack (got expert {expert})")
        p = self.partition
        if shard is None:
            full = sum(layer.out_shards.values())
            _check_full(tensor, (full,) if is_bias else (full, layer.in_features), f"the {kind}")
            if (self.shard_partitions or p is not None and p.dim == 0) and len(layer.out_shards) > 1:
                # A whole fused tensor under a column split: each part is split on its own.
                for name, part in zip(layer.out_shards, tensor.split(list(layer.out_shards.values()))):
                    self._load(layer, param, part, name, None, is_bias)
                return
            target, what = param, f"the {kind}"
        else:
            rows, p = self._rows(layer, shard), self._part(shard)
            size = layer.out_shards[shard]
            what = f"shard {shard!r} of the {kind}"
            _check_full(tensor, (size,) if is_bias else (size, layer.in_features), what)
            target = param[rows]
        if p is not None and (p.dim == 0 or not is_bias):
            tensor = p.take(tensor, p.dim)
        copy_checked(target, tensor, what)

    def _load_weight(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                     expert: int | None = None) -> None:
        self._load(layer, param, tensor, shard, expert, is_bias=False)

    def _load_bias(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                   expert: int | None = None) -> None:
        self._load(layer, param, tensor, shard, expert, is_bias=True)

    # -- compute ----------------------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, None if self._skip_bias else layer.bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if self.partition is not None:
            raise NotImplementedError("a vocab-parallel embedding needs masking and an all-reduce")
        return F.embedding(ids, layer.weight)

    def _same_kind(self, layer: nn.Module, other: nn.Module) -> bool:
        f = getattr(other, "format", None)
        return type(f) is DenseFormat and f.partition == self.partition and \
            other.weight.shape[1:] == layer.weight.shape[1:] and other.weight.dtype == layer.weight.dtype

    def tie(self, layer: nn.Module, source: nn.Module) -> None:
        if not self._same_kind(layer, source) or source.weight.shape != layer.weight.shape or layer.bias is not None:
            raise ValueError(f"cannot tie a {tuple(layer.weight.shape)} dense weight to {source.format!r} "
                             f"{tuple(source.weight.shape)}")
        layer.weight = source.weight

    def can_concat_out(self, layer: nn.Module, other: nn.Module) -> bool:
        return self.partition is None and self._same_kind(layer, other) and layer.bias is None and \
            other.bias is None

    @torch.no_grad()
    def concat_out(self, layer: nn.Module, other: nn.Module) -> None:
        if not self.can_concat_out(layer, other):
            raise ValueError(f"cannot concatenate {other.format!r} after {self!r}")
        layer.weight = nn.Parameter(torch.cat([layer.weight, other.weight]), requires_grad=False)
        layer.out_shards = {"": layer.weight.shape[0]}


class DenseExperts(ExpertFormat):
    """gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I], as transformers 5 stacks
    them; applied by kernels.moe.fused_moe (torch reference on the CPU, Triton grouped GEMM on the GPU).

    Needs the layer's `num_experts` and `intermediate` (set by the layer before create_params)."""

    def __repr__(self) -> str:
        return "DenseExperts()"

    def create_params(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                      dtype: torch.dtype) -> None:
        e = range(num_experts)
        register_param(layer, "gate_up_proj", new_param((num_experts, 2 * intermediate, hidden), dtype),
                       self._load_gate_up, tuple(f"{i}.{s}" for i in e for s in ("gate", "up")))
        register_param(layer, "down_proj", new_param((num_experts, hidden, intermediate), dtype),
                       self._load_down, tuple(str(i) for i in e))

    @staticmethod
    def _slot(layer: nn.Module, param: torch.Tensor, expert: int) -> torch.Tensor:
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} is out of range (the config has {layer.num_experts})")
        return param[expert]

    def _load_gate_up(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                      expert: int | None = None) -> None:
        if expert is None:
            if shard is not None:
                raise ValueError(f"shard {shard!r} of the stacked experts needs an expert index")
            copy_checked(param, tensor, "the stacked gate|up experts")
            return
        target, what = self._slot(layer, param, expert), f"expert {expert}'s gate|up"
        if shard is not None:
            i = layer.intermediate
            if shard not in ("gate", "up"):
                raise ValueError(f"expert {expert} has no shard {shard!r} (its shards: gate, up)")
            target, what = (target[:i] if shard == "gate" else target[i:]), f"expert {expert}'s {shard}"
        copy_checked(target, tensor, what)

    def _load_down(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                   expert: int | None = None) -> None:
        if shard is not None:
            raise ValueError(f"the down projection has no shard {shard!r}")
        if expert is None:
            copy_checked(param, tensor, "the stacked down experts")
        else:
            copy_checked(self._slot(layer, param, expert), tensor, f"expert {expert}'s down")

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids)

    @torch.no_grad()
    def fold_in(self, layer: nn.Module, gate_up: nn.Module, down: nn.Module) -> bool:
        dense = [getattr(m, "format", None) for m in (gate_up, down)]
        if any(type(f) is not DenseFormat or f.partition is not None for f in dense) or \
                gate_up.bias is not None or down.bias is not None or \
                tuple(gate_up.weight.shape) != tuple(layer.gate_up_proj.shape[1:]) or \
                tuple(down.weight.shape) != tuple(layer.down_proj.shape[1:]) or \
                gate_up.weight.dtype != layer.gate_up_proj.dtype:
            return False
        layer.gate_up_proj = nn.Parameter(torch.cat([layer.gate_up_proj, gate_up.weight[None]]), requires_grad=False)
        layer.down_proj = nn.Parameter(torch.cat([layer.down_proj, down.weight[None]]), requires_grad=False)
        layer.num_experts += 1
        return True
