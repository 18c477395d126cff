"""compressed-tensors `pack-quantized` int4 weights (the format llm-compressor writes for W4A16), repacked
at load into the grouped-integer layout (int4_native.py).

Per Linear: `weight_packed` int32 [N, K/8] (eight values along K per int32, value j in bits 4j.., each
stored as q + 8 for q in -8..7), `weight_scale` [N, K/G] (strategy "group"; "channel": [N, 1]),
`weight_zero_point` int32 [N/8, K/G] for asymmetric schemes (packed along N, also + 8), `weight_shape`
[2] = (N, K), and `weight_g_idx` [K] with act-order. W[n, k] = (q[n, k] - zp[n, g]) * scale[n, g].
The compressed-tensors parser (weight_formats/compressed_tensors.py) calls choose_ct_int4 per layer.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lamina.models.weight_formats.int4_native import NativeInt4Format, NativeTensor, group_perm, unpack_int32


class CTInt4Format(NativeInt4Format):
    """group: input columns per scale (the whole row for strategy "channel", resolved per layer)."""

    def __init__(self, group: int, symmetric: bool, actorder: bool) -> None:
        super().__init__(4, group)
        self.symmetric, self.actorder = symmetric, actorder
        self.tp_splits_inputs = not actorder  # act order: groups are not contiguous in K

    def native_tensors(self, in_features: int) -> tuple[NativeTensor, ...]:
        g, G = in_features // self.group, self.group
        tensors = [NativeTensor("weight_packed", lambda k, n: (n, k // 8), torch.int32, 0, in_dim=1, in_unit=8),
                   NativeTensor("weight_scale", lambda k, n: (n, g), torch.float32, 0, in_dim=1, in_unit=G),
                   NativeTensor("weight_shape", lambda k, n: (2,), torch.int64, None)]
        if not self.symmetric:
            tensors.append(NativeTensor("weight_zero_point", lambda k, n: (n // 8, g), torch.int32, 0, pack=8,
                                        in_dim=1, in_unit=G))
        if self.actorder:
            tensors.append(NativeTensor("weight_g_idx", lambda k, n: (k,), torch.int32, None, in_dim=0))
        return tuple(tensors)

    def to_layout(self, layer: nn.Module):
        for (name, size), shape in zip(layer.out_shards.items(), layer.weight_shape.tolist()):
            if tuple(shape) != (size, layer.in_features):
                raise ValueError(f"weight_shape {tuple(shape)} of part {name!r} does not match the layer's "
                                 f"({size}, {layer.in_features})")
        u = unpack_int32(layer.weight_packed, 1)  # [N, K], q + 8
        s = layer.weight_scale.float()
        zp = unpack_int32(layer.weight_zero_point, 0).float() - 8 if not self.symmetric else torch.zeros_like(s)
        perm = None
        if self.actorder:
            perm = group_perm(self.shard_g_idx(layer, layer.weight_g_idx, "weight_g_idx"), self.group,
                              "weight_g_idx")
            if perm is not None:
                u = u[:, perm]
        return u, s, -(8 + zp) * s, perm


def choose_ct_int4(scheme: dict[str, Any], layer_name: str, layer: nn.Module) -> CTInt4Format:
    """The format of one layer under a compressed-tensors int4 pack-quantized scheme (a config group, or
    its "weights" entry); refuses what it does not support with one line."""
    w = scheme.get("weights", scheme)
    bits, kind = int(w.get("num_bits", 0)), w.get("type", "int")
    strategy = str(w.get("strategy", "group")).lower()
    if kind != "int" or bits != 4:
        raise ValueError(f"{layer_name}: unsupported pack-quantized weights ({kind}{bits}); supported: int4")
    if type(layer).__name__ != "Linear":
        raise ValueError(f"{layer_name}: int4 pack-quantized {type(layer).__name__} layers are not supported; "
                         "supported: Linear")
    if strategy == "group":
        group = int(w.get("group_size") or 0)
    elif strategy == "channel":
        group = layer.in_features
    else:
        raise ValueError(f"{layer_name}: unsupported int4 strategy {strategy!r}; supported: group, channel")
    actorder = w.get("actorder") == "group"  # "weight" and "static" orders keep k // group: no g_idx
    return CTInt4Format(group, bool(w.get("symmetric", True)), actorder)
