"""The base of the 4-bit checkpoint formats (GPTQ, AWQ, compressed-tensors pack-quantized): each stores a
weight as several tensors (packed integers, zero points, scales, a group index) that only together give
the weight, so the layer first holds them as they are in the checkpoint (`NativeTensor`s, named like the
checkpoint's, fused parts sliced along the output features), and `finish_loading` repacks them into the
grouped-integer layout of int4_groups.py (GroupQuantFormat), then drops the checkpoint's copies.

Act-order checkpoints (a group index that is not k // group) keep their groups contiguous after a column
permutation: the stored weight's columns are sorted by group, and the activations are gathered the same way
(`perm`, applied by wq_linear).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lamina.models.weight_formats.base import Cut, clear_params, copy_checked, new_param, register_param
from lamina.models.weight_formats.int4_groups import SCALE_DTYPE, GroupQuantFormat

SUPPORTED_BITS = (4,)


@dataclass(frozen=True)
class NativeTensor:
    """One checkpoint tensor of a layer: shape(k, n) for n output features; `out_dim`: the dim that runs
    over output features (None: one per shard, like a group index), `pack`: output features per element
    along it (8 for int32-packed 4-bit values)."""

    name: str
    shape: Callable[[int, int], tuple[int, ...]]
    dtype: torch.dtype
    out_dim: int | None
    pack: int = 1
    in_dim: int | None = None  # the dim that runs over input features (tensor parallelism's row split)
    in_unit: int = 1  # input features per entry along it (8 for int32 packed along K; the group for scales)


def check_bits_group(bits: int, group: int, k: int | None = None) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported weight bit width {bits}; supported: {', '.join(map(str, SUPPORTED_BITS))}")
    if group <= 0 or group % 8 or (k is not None and k % group):
        raise ValueError(f"unsupported group size {group}" + (f" for {k} input features" if k else "") +
                         "; supported: a multiple of 8 that divides the input features (e.g. 32, 64, 128)")


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 holding eight 4-bit values each (value j in bits 4j..4j+3) -> int32 values 0..15, 8x longer
    along `dim`."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    vals = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8] after the last dim
    vals = vals.movedim(-1, dim + 1) if dim != packed.dim() - 1 else vals
    shape = list(packed.shape)
    shape[dim] *= 8
    return vals.reshape(shape)


def pack_layout(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> uint8 [N, K/2] (the wq_matmul layout)."""
    q = q.to(torch.uint8).reshape(q.shape[0], -1, 2)
    return (q[..., 0] | (q[..., 1] << 4)).contiguous()


def group_perm(g_idx: torch.Tensor, group: int, what: str) -> torch.Tensor | None:
    """None when g_idx is the plain k // group; else the column order that makes groups contiguous
    (refused unless every group then holds exactly `group` columns)."""
    k = g_idx.numel()
    plain = torch.arange(k, device=g_idx.device) // group
    if torch.equal(g_idx.long(), plain):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], plain):
        raise ValueError(f"{what}: the group index does not put {group} columns in each group")
    return perm


class NativeInt4Format(GroupQuantFormat):
    """Subclasses list their checkpoint tensors (`native_tensors`) and implement `to_layout`."""

    def native_tensors(self, in_features: int) -> tuple[NativeTensor, ...]:
        raise NotImplementedError

    def __init__(self, bits: int, group: int) -> None:
        check_bits_group(bits, group)
        super().__init__(bits, group)

    def create_params(self, layer: nn.Module, in_features: int, out_shards: Mapping[str, int], bias: bool,
                      dtype: torch.dtype) -> None:
        check_bits_group(self.bits, self.group, in_features)
        self.dtype = dtype
        n = sum(out_shards.values())
        parts = tuple(s for s in out_shards if s)
        for t in self.native_tensors(in_features):
            if t.out_dim is None:  # one per shard (a group index): stacked
                shape = (len(out_shards), *t.shape(in_features, n))
            else:
                for size in out_shards.values():
                    if size % t.pack:
                        raise ValueError(f"{t.name}: {size} output features do not pack by {t.pack}")
                shape = t.shape(in_features, n)
            register_param(layer, t.name, new_param(shape, t.dtype), self._native_loader(t), parts)
        if bias:
            register_param(layer, "bias", new_param((n,), dtype), self._load_bias, parts)
        else:
            layer.register_parameter("bias", None)

    def _native_loader(self, t: NativeTensor):
        def load(layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                 expert: int | None = None) -> None:
            if expert is not None:
                raise ValueError(f"this {t.name} is not an expert stack (got expert {expert})")
            what = f"shard {shard!r} of {t.name}" if shard else t.name
            if t.out_dim is None:
                index = list(layer.out_shards).index(shard or "") if (shard or "") in layer.out_shards else None
                if index is None:
                    raise ValueError(f"no shard {shard!r}")
                copy_checked(param[index], tensor, what)
                return
            if not shard:
                copy_checked(param, tensor, what)
                return
            rows = _shard_slice(layer, shard, t.pack)
            copy_checked(param.narrow(t.out_dim, rows.start, rows.stop - rows.start), tensor, what)

        return load

    # An act-order group index cannot be split along K (a rank's columns fall in any group): such a format
    # is computed column-parallel over the gathered input instead (parallel/tp_quant.py).
    tp_splits_inputs = True

    def tp_slice(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: str | None, cut: Cut,
                 ) -> torch.Tensor:
        if name == "bias":
            return cut.along(tensor, 0, what=name) if cut.dim == 0 else tensor
        t = next(t for t in self.native_tensors(layer.in_features) if t.name == name)
        what = f"{name} of shard {shard!r}" if shard else name
        if name == "weight_shape":  # (N, K) of the part: the local sizes now
            return torch.tensor([layer.out_shards[shard or ""], layer.in_features], dtype=tensor.dtype)
        if cut.dim == 0:
            return tensor if t.out_dim is None else cut.along(tensor, t.out_dim, t.pack, what=what)
        if t.in_dim is None:
            return tensor
        piece = cut.along(tensor, t.in_dim, t.in_unit, what=what)
        if t.out_dim is None:  # a group index: its groups renumbered from this rank's first
            piece = piece - cut.start // self.group
        return piece

    def to_layout(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q values [N, K] 0..15 in the stored column order, scales [N, K/G], offsets [N, K/G], perm)."""
        raise NotImplementedError

    @torch.no_grad()
    def finish_loading(self, layer: nn.Module) -> None:
        if layer.__dict__.get("_native_done"):
            return super().finish_loading(layer)
        q, s, o, perm = self.to_layout(layer)
        bias = layer.bias
        clear_params(layer)
        layer.register_parameter("weight", nn.Parameter(pack_layout(q), requires_grad=False))
        layer.register_buffer("weight_scales", s.to(SCALE_DTYPE).contiguous())
        layer.register_buffer("weight_offsets", o.to(SCALE_DTYPE).contiguous())
        layer.register_parameter("bias", bias)
        layer.__dict__["_native_done"] = True
        layer.__dict__["_perm"] = perm
        super().finish_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from lamina.kernels.wq_matmul import wq_linear

        d = layer.__dict__
        return wq_linear(x, layer.weight, layer.weight_scales, layer.weight_offsets, self.bits, layer.bias,
                         perm=d.get("_perm"), cpu_pack=d.get("_cpu_pack"), cpu_dense=d.get("_cpu_dense"),
                         kn=d.get("_kn"))

    def dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The dense [N, K] weight in the checkpoint's column order."""
        w = super().dequantized(layer, dtype)
        perm = layer.__dict__.get("_perm")
        if perm is None:
            return w
        out = torch.empty_like(w)
        out[:, perm] = w
        return out

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not quantize embeddings")

    def tie(self, layer: nn.Module, source: nn.Module) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not quantize a tied lm_head")

    def shard_g_idx(self, layer: nn.Module, g_idx: torch.Tensor, what: str) -> torch.Tensor:
        """One group index for the layer: every fused part must have the same one."""
        if any(not torch.equal(g_idx[0], g) for g in g_idx[1:]):
            raise ValueError(f"{what}: the fused parts of {layer.out_shards} have different group orders")
        return g_idx[0]


def _shard_slice(layer: nn.Module, shard: str, pack: int) -> slice:
    start = 0
    for name, size in layer.out_shards.items():
        if name == shard:
            return slice(start // pack, (start + size) // pack)
        start += size
    raise ValueError(f"no shard {shard!r} (its shards: {', '.join(n for n in layer.out_shards if n)})")
