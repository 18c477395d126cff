"""The weight-format seam: how a layer's weights are stored, loaded from a checkpoint and multiplied.

A layer with weights (Linear, Embedding, the MoE expert stack) does not own parameters of its own: it hands
its logical shape to a format object, and the format

- creates the parameters on the layer (`create_params`), with whatever names, dtypes and shapes its storage
  needs (dense: `weight` [out, in] + `bias`; FP8 blocks later: `weight` float8 + `weight_scale_inv`;
  4-bit groups: `qweight`/`scales`/`qzeros`; a LoRA wrapper: the base format's parameters + `lora_a`/`lora_b`);
- registers one loader per parameter (`register_param`): the loader takes a checkpoint tensor, possibly one
  named part of a fused projection (shard "q", "gate", ...) and/or one expert of a stack, and writes it into
  its slice of the parameter, converting dtype and device on the way and refusing a wrong shape;
- applies the layer (`apply`: the matmul; `embed`: the row lookup; the expert format: the grouped MoE).

The model loader never copies into parameters itself: it maps each checkpoint tensor to a `Target`
(parameter name, shard, expert; see weights.py) and calls that parameter's loader. A tensor-parallel rank's
format creates only its slice and its loaders cut that slice out of the full checkpoint tensor (Partition).
So a new storage format, a LoRA delta or a TP shard is a new format class, chosen per layer by name before
the weights are materialized (`lamina.models.weight_formats.assign_formats`); the layers never change.

Loaders are kept in `layer.weight_loaders` (parameter name -> function of (layer, param, tensor, shard,
expert)), not as attributes of the parameters: `Module.to_empty` replaces the meta parameters with new
objects, and a loader bound to its layer would make a reference cycle that delays freeing a model's memory.
`weight_loader(module, name)` returns the (param, tensor, shard=None, expert=None) callable the loader uses.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


class LayerLoader(Protocol):
    def __call__(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                 expert: int | None = None) -> None: ...


WeightLoader = Callable[..., None]  # (param, tensor, shard=None, expert=None) -> None


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter of a layer is loaded: its loader, and the named parts that must each arrive
    (shards "q", "k", "v"; experts "3.gate"; empty: the parameter is one whole tensor)."""

    loader: LayerLoader
    parts: tuple[str, ...] = ()


def part_key(shard: str | None, expert: int | None) -> str:
    """The name of one loaded part: "q" (a shard), "3" (expert 3's whole matrix), "3.up" (a shard of it)."""
    if expert is None:
        return shard or ""
    return f"{expert}.{shard}" if shard else str(expert)


def register_param(layer: nn.Module, name: str, param: nn.Parameter, loader: LayerLoader,
                   parts: tuple[str, ...] = ()) -> None:
    """Puts `param` on `layer` as `name` and records how the checkpoint fills it (called by formats)."""
    layer.register_parameter(name, param)
    specs = layer.__dict__.setdefault("weight_loaders", {})
    specs[name] = ParamSpec(loader, parts)


def clear_params(layer: nn.Module) -> None:
    """Drops every parameter and buffer of `layer` (before another format creates its own): a layer with a
    weight format holds only what its format registered. (Buffers: state a format derives while loading,
    e.g. the scales of weights quantized on the fly; they are not expected from the checkpoint.)"""
    for name in [*layer._parameters, *layer._buffers]:
        delattr(layer, name)
    layer.__dict__["weight_loaders"] = {}


def new_param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """Uninitialized storage on the current default device (meta while the model is being built)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def copy_checked(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    """target <- tensor (cast to target's dtype and device on the way), refusing a shape mismatch."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"{what} expects shape {tuple(target.shape)}, the checkpoint has {tuple(tensor.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def default_weight_loader(layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                          expert: int | None = None) -> None:
    """For parameters no format owns (norm weights, conv kernels, gate biases): one whole tensor, same shape."""
    if shard is not None or expert is not None:
        raise ValueError(f"this parameter is one tensor; it has no part {part_key(shard, expert)!r}")
    copy_checked(param, tensor, "the parameter")


def param_spec(module: nn.Module, name: str) -> ParamSpec:
    return module.__dict__.get("weight_loaders", {}).get(name) or ParamSpec(default_weight_loader)


def weight_loader(module: nn.Module, name: str) -> WeightLoader:
    """The loader of `module`'s parameter `name`: call it as loader(param, tensor, shard=None, expert=None)."""
    loader = param_spec(module, name).loader

    def load(param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None, expert: int | None = None) -> None:
        loader(module, param, tensor, shard, expert)

    return load


@dataclass(frozen=True)
class Partition:
    """This rank's slice of a tensor-parallel layer: `dim` 0 splits the output rows (column parallel: each
    rank computes out/world of the features; each fused shard is split on its own, so a rank holds
    [q_r | k_r | v_r]), `dim` 1 splits the input columns (row parallel: each rank's output is a partial sum
    that the caller all-reduces; the bias is added on rank 0 only). Sizes must divide by `world`."""

    rank: int
    world: int
    dim: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world or self.dim not in (0, 1):
            raise ValueError(f"bad partition rank={self.rank} world={self.world} dim={self.dim}")

    def local(self, size: int) -> int:
        if size % self.world:
            raise ValueError(f"size {size} does not split over {self.world} ranks")
        return size // self.world

    def take(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor along `dim` (a view; nothing is copied)."""
        n = self.local(tensor.shape[dim])
        return tensor.narrow(dim, self.rank * n, n)


@dataclass(frozen=True)
class Cut:
    """A tensor-parallel rank's piece of one weight (one fused part of it): features [start, start + size)
    of `full` along `dim` (0: output features, column parallel; 1: input features, row parallel)."""

    dim: int
    start: int
    size: int
    full: int

    def along(self, tensor: torch.Tensor, tdim: int, unit: int = 1, width: int = 1, what: str = "tensor",
              ) -> torch.Tensor:
        """This piece of `tensor` along its dim `tdim`, where each `unit` features take `width` entries (a
        packed int32 holds 8 values: unit 8; a block scale covers 128: unit 128; a GGUF Q4_K super-block is
        256 features in 144 bytes: unit 256, width 144). The last index may cover a partial block when the
        piece ends the tensor (ceil-divided block scales). Refuses a piece that splits a block."""
        stop = self.start + self.size
        if self.start % unit or (stop % unit and stop != self.full):
            side = ("output", "input")[self.dim]
            raise ValueError(f"{what}: this rank's {side} features [{self.start}, {stop}) of {self.full} do not "
                             f"fall on its blocks of {unit} (choose a tensor-parallel size that keeps whole "
                             "quantization blocks on each rank)")
        first, count = self.start // unit * width, -(-self.size // unit) * width
        if tensor.shape[tdim] != -(-self.full // unit) * width:
            raise ValueError(f"{what} expects {-(-self.full // unit) * width} entries along dim {tdim} for "
                             f"{self.full} features, the checkpoint has shape {tuple(tensor.shape)}")
        return tensor.narrow(tdim, first, count)


class WeightFormat(ABC):
    """Storage + loading + matmul of one linear-shaped weight [out, in] (Linear, Embedding, lm_head).

    `out_shards` names the parts of a fused projection in order ({"q": Q, "k": KV, "v": KV}); an unfused
    layer passes {"": out}. Sizes are the full (unpartitioned) ones. Subclasses implement create_params and
    apply; embed, tie and concat_out are optional capabilities."""

    @abstractmethod
    def create_params(self, layer: nn.Module, in_features: int, out_shards: Mapping[str, int], bias: bool,
                      dtype: torch.dtype) -> None:
        """Registers the layer's parameters (register_param) with their loaders; runs on the meta device."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the [num_embeddings, dim] weight (a format that can serve as an embedding table)."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve as an embedding table")

    def tie(self, layer: nn.Module, source: nn.Module) -> None:
        """Makes `layer` (lm_head) read `source`'s (the embedding's) weights instead of its own."""
        raise NotImplementedError(f"{type(self).__name__} cannot tie lm_head to the embedding")

    def can_concat_out(self, layer: nn.Module, other: nn.Module) -> bool:
        """Whether concat_out(layer, other) would succeed (an optimization may then rely on it)."""
        return False

    def tp_slice(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: str | None, cut: Cut,
                 ) -> torch.Tensor:
        """Tensor parallelism (lamina/parallel/tp_quant.py): this rank's piece of the full checkpoint tensor
        for parameter `name` (fused part `shard`), as the parameter's own loader then takes it. The layer
        already holds the local sizes. Refuses (ValueError, one line) a cut inside a quantization block.
        Not implemented: the format cannot be split (dense formats split through parallel/tp_formats.py)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be split for tensor parallelism")

    def concat_out(self, layer: nn.Module, other: nn.Module) -> None:
        """Appends `other`'s output features after `layer`'s (after loading; used to fold a shared expert's
        gate into the router)."""
        raise NotImplementedError(f"{type(self).__name__} cannot concatenate layers")


class ExpertFormat(ABC):
    """Storage + loading + grouped matmul of a MoE layer's routed experts (SwiGLU: gate|up, then down).

    Loaders take `expert` (the index in the stack) and `shard` ("gate" | "up" for the first projection; none
    for down); a call with neither loads the whole stack at once.

    Parallel layouts are formats too: tensor parallelism splits each expert's intermediate dim (gate/up rows
    and down columns, with a Partition as for Linear); expert parallelism stacks only this rank's experts,
    its loaders map a global expert index to a local slot and skip the others, and its `parts` list only the
    local experts (so the missing-tensor check asks for exactly what this rank holds)."""

    @abstractmethod
    def create_params(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                      dtype: torch.dtype) -> None:
        """Registers the stacked parameters with their loaders; runs on the meta device."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: the sum over each token's chosen experts of weight * down(silu(gate) * up)."""

    def fold_in(self, layer: nn.Module, gate_up: nn.Module, down: nn.Module) -> bool:
        """Appends one more expert made of two Linear layers (a shared expert), if this format can hold them;
        returns whether it did (False leaves everything as it was)."""
        return False

    def tp_slice(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: str | None, cut: Cut,
                 ) -> torch.Tensor:
        """As WeightFormat.tp_slice for ONE expert's tensor of parameter `name`: `cut` is along the
        intermediate dim (output rows of gate/up: dim 0; input columns of down: dim 1)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be split for tensor parallelism")
