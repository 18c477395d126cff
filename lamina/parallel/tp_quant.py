"""Tensor parallelism for quantized weights: any weight format that says how it slices (`tp_slice`) gets a
column- or row-parallel layout, without a table of special cases here.

A quantized weight is several checkpoint tensors (FP8 values + block scales; GPTQ qweight / qzeros / scales /
g_idx; GGUF block bytes). Each rank's layer is the inner format created at its LOCAL sizes (the layer's
`in_features` / `out_shards` are set to them, so the format's own shape checks and shard offsets are the
local ones), and every loader of the inner format is wrapped: the full checkpoint tensor (one fused part at
a time) is first cut by the format's `tp_slice(layer, name, tensor, shard, cut)` to this rank's piece, then
handed to the format's own loader as if the checkpoint had been written for this rank. A cut that does not
fall on a quantization block / group boundary is refused there with one line naming the tensor and the sizes
(load_weights prefixes the checkpoint tensor's name): dequantizing such a tensor would silently change the
memory the user planned for, and no supported model hits it at the usual sizes (128-wide groups, heads of
64/128).

One exception is not a refusal: an act-order (desc_act / actorder "group") int4 weight cannot be split along
its input features (a rank's columns belong to arbitrary groups). Its row-parallel layer is computed as a
column-parallel one instead: the input is all-gathered (cheap: [tokens, K]), each rank computes its N/world
output features over the full K, and the outputs are all-gathered. Same memory, exact, two gathers instead
of one all-reduce (`QuantParallel.gathers_input`).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lamina.models.weight_formats.base import Cut, ExpertFormat, ParamSpec, Partition, WeightFormat
from lamina.parallel.context import ParallelContext

__all__ = ["Cut", "QuantParallel", "QuantTPExperts", "can_split", "local_loader", "quant_tp_choice"]


def _wrap_loaders(layer: nn.Module, sliced) -> None:
    """Puts the cut in front of each of the inner format's loaders; the uncut ones stay reachable through
    `local_loader` (random benchmark weights are drawn at the local shape)."""
    specs = layer.__dict__["weight_loaders"]
    layer.__dict__["tp_local_loaders"] = {name: spec.loader for name, spec in specs.items()}
    for name, spec in list(specs.items()):
        specs[name] = ParamSpec(sliced(name, spec.loader), spec.parts)


def local_loader(layer: nn.Module, name: str):
    """The (param, tensor, shard=None, expert=None) loader of `name` that takes a tensor already at this rank's
    local shape (no cut), or None when the layer is not a quantized tensor-parallel one."""
    loader = layer.__dict__.get("tp_local_loaders", {}).get(name)
    if loader is None:
        return None
    return lambda param, tensor, shard=None, expert=None: loader(layer, param, tensor, shard, expert)


def can_split(fmt: WeightFormat | ExpertFormat) -> bool:
    """Whether `fmt` declares how its tensors slice for tensor parallelism."""
    base = WeightFormat if isinstance(fmt, WeightFormat) else ExpertFormat
    return type(fmt).tp_slice is not base.tp_slice


class QuantParallel(WeightFormat):
    """A quantized Linear / Embedding split over the ranks. dim 0: column parallel (each fused part split on
    its own; `shard_partitions` as in ColumnParallel; gather: lm_head's logits all-gathered); dim 1: row
    parallel (partial sums all-reduced; the bias added by rank 0 alone: the others load it as zeros)."""

    def __init__(self, inner: WeightFormat, ctx: ParallelContext, dim: int,
                 shard_partitions: Mapping[str, Partition] | None = None, gather: bool = False,
                 name: str = "the layer") -> None:
        if not can_split(inner):
            raise ValueError(f"tensor parallelism cannot split {inner!r} weights ({name}) yet")
        self.inner, self.ctx, self.dim, self.name = inner, ctx, dim, name
        self.shard_partitions = dict(shard_partitions or {})
        self.gather = gather
        # A row split of an input-unsplittable format is computed column-parallel over the gathered input.
        self.gathers_input = dim == 1 and not getattr(inner, "tp_splits_inputs", True)
        self.partition = Partition(ctx.rank, ctx.world, 0 if self.gathers_input else dim)

    def __repr__(self) -> str:
        how = "row(gathered input)" if self.gathers_input else ("column", "row")[self.dim]
        return f"QuantParallel({self.inner!r}, {how}, rank={self.ctx.rank}/{self.ctx.world})"

    def __getattr__(self, name: str):
        # finish_loading, dequantized, scheme, bits, ...: the inner format's (only reached for names not here)
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _column(self) -> bool:
        return self.partition.dim == 0

    def _part(self, shard: str) -> Partition:
        return self.shard_partitions.get(shard, self.partition)

    def cut(self, shard: str | None) -> Cut:
        """This rank's features of fused part `shard` (column) or of the input (row)."""
        if self._column():
            full = self.full_shards[shard or ""]
            p = self._part(shard or "")
            n = p.local(full)
            return Cut(0, p.rank * n, n, full)
        n = self.partition.local(self.full_in)
        return Cut(1, self.ctx.rank * n, n, self.full_in)

    def create_params(self, layer: nn.Module, in_features: int, out_shards: Mapping[str, int], bias: bool,
                      dtype: torch.dtype) -> None:
        self.full_in, self.full_shards = in_features, dict(out_shards)
        if self._column():
            local_in = in_features
            local = {n: self._part(n).local(s) for n, s in out_shards.items()}
        else:
            local_in, local = self.partition.local(in_features), dict(out_shards)
        # The layer describes its local weight from here on: the inner format's offsets and checks use it.
        layer.in_features, layer.out_shards = local_in, local
        try:
            self.inner.create_params(layer, local_in, local, bias, dtype)
        except ValueError as e:  # the format's own checks, on this rank's piece: say which layer and split
            raise ValueError(f"--tensor-parallel-size {self.ctx.world}: {self.name} (this rank's piece: "
                             f"{local_in} input features, parts {local}): {e}") from None
        _wrap_loaders(layer, self._sliced)

    def _sliced(self, name: str, loader):
        def load(layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                 expert: int | None = None) -> None:
            if self._column() and shard is None and len(self.full_shards) > 1:
                raise ValueError("a quantized fused projection under tensor parallelism loads one part at a time")
            if name == "bias" and not self._column():
                if self.ctx.rank != 0:  # the partial sums are all-reduced: one rank adds the bias
                    tensor = torch.zeros_like(tensor)
            else:
                tensor = self.inner.tp_slice(layer, name, tensor, shard, self.cut(shard))
            loader(layer, param, tensor, shard, expert)

        return load

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.gathers_input:
            return self.ctx.gather_last(self.inner.apply(layer, self.ctx.gather_last(x)))
        y = self.inner.apply(layer, x)
        if self._column():
            return self.ctx.gather_last(y) if self.gather else y
        return self.ctx.all_reduce(y)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank looks up the ids in its rows, zeros the others, the ranks sum."""
        if not self._column():
            raise NotImplementedError("a row-parallel layer cannot serve as an embedding table")
        rows = layer.out_shards[""]
        local = ids - self.ctx.rank * rows
        outside = (local < 0) | (local >= rows)
        out = self.inner.embed(layer, local.masked_fill(outside, 0))
        return self.ctx.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def tie(self, layer: nn.Module, source: nn.Module) -> None:
        f = getattr(source, "format", None)
        if not isinstance(f, QuantParallel) or f.partition != self.partition or not f._column():
            raise ValueError(f"cannot tie a vocab-parallel {self!r} lm_head to {f!r}")
        source.format = f.inner  # the inner formats check each other's storage
        try:
            self.inner.tie(layer, source)
        finally:
            source.format = f

    def can_concat_out(self, layer: nn.Module, other: nn.Module) -> bool:
        return False


class QuantTPExperts(ExpertFormat):
    """Quantized routed experts split along their intermediate dim (as TPExperts splits dense ones): gate and
    up rows [r*I/w, (r+1)*I/w) and the same down columns of every expert, cut by the inner format's
    tp_slice; the partial expert sums are all-reduced."""

    def __init__(self, inner: ExpertFormat, ctx: ParallelContext, name: str = "the experts") -> None:
        if not can_split(inner):
            raise ValueError(f"tensor parallelism cannot split {inner!r} experts ({name}) yet")
        self.inner, self.ctx, self.name = inner, ctx, name
        self.part = Partition(ctx.rank, ctx.world, 0)

    def __repr__(self) -> str:
        return f"QuantTPExperts({self.inner!r}, rank={self.ctx.rank}/{self.ctx.world})"

    def __getattr__(self, name: str):
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def create_params(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                      dtype: torch.dtype) -> None:
        self.full_intermediate = intermediate
        local = self.part.local(intermediate)
        layer.intermediate = local  # the inner format's gate/up offsets are the local ones
        try:
            self.inner.create_params(layer, num_experts, hidden, local, dtype)
        except ValueError as e:
            raise ValueError(f"--tensor-parallel-size {self.ctx.world}: {self.name} (this rank's intermediate "
                             f"size {local} of {intermediate}): {e}") from None
        _wrap_loaders(layer, self._sliced)

    def _sliced(self, name: str, loader):
        down = name.startswith("down_proj")
        n = self.part.local(self.full_intermediate)
        cut = Cut(1 if down else 0, self.part.rank * n, n, self.full_intermediate)

        def load(layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                 expert: int | None = None) -> None:
            if expert is None:  # a stacked tensor: one expert at a time
                if shard is not None:
                    raise ValueError(f"shard {shard!r} of the stacked experts needs an expert index")
                for e in range(tensor.shape[0]):
                    load(layer, param, tensor[e], None, e)
                return
            if not down and shard is None and tensor.numel() > 1 and not name.endswith("input_scale"):
                halves = tensor.chunk(2, dim=0)  # a whole gate|up matrix: each half cut on its own
                for half, part in zip(("gate", "up"), halves):
                    load(layer, param, part, half, expert)
                return
            loader(layer, param, self.inner.tp_slice(layer, name, tensor, shard, cut), shard, expert)

        return load

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(self.inner.apply(layer, x, topk_weights, topk_ids))

    def fold_in(self, layer: nn.Module, gate_up: nn.Module, down: nn.Module) -> bool:
        return False


def quant_tp_choice(ctx: ParallelContext, quantized, dense):
    """The FormatChoice of a tensor-parallel rank with a quantized checkpoint (or --quantization): the layer's
    role picks the split (`dense`: tp_plan.tp_format_choice), the checkpoint's config picks the storage
    (`quantized`: quantization.format_chooser, GGUF's plan); a layer the config keeps dense keeps its dense
    tensor-parallel format, a replicated one (the router) its quantized format whole on every rank."""
    from lamina.parallel.tp_formats import ColumnParallel, RowParallel, TPExperts

    if quantized is None:
        return dense

    def choose(name: str, module: nn.Module):
        split = dense(name, module)
        fmt = quantized(name, module)
        if fmt is None or split is None:
            return split if fmt is None else fmt
        if isinstance(split, TPExperts):
            return QuantTPExperts(fmt, ctx, name)
        if isinstance(split, RowParallel):
            return QuantParallel(fmt, ctx, 1, name=name)
        if isinstance(split, ColumnParallel):
            return QuantParallel(fmt, ctx, 0, split.shard_partitions, split.gather, name)
        raise ValueError(f"tensor parallelism does not split the quantized layer {name} ({fmt!r}) yet")

    return choose
