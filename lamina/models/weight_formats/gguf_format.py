"""GGUF weights kept quantized: which layers keep their blocks (plan_gguf), and the format that repacks a
GGUF tensor's blocks into the grouped-integer layout as it loads (GGUFFormat).

A layer is kept quantized when every part of it (q, k, v of a fused projection) is one of the supported
block types (gguf_blocks.SUPPORTED); a fused layer whose parts differ takes the widest layout among them
(8 bits if any part has more than 4; groups of 16 if any is Q6_K), which holds each part's values exactly.
A layer with a float part (F32/F16/BF16) stays dense, as do the tensors of other block types, which are
dequantized at load as before (the loader refuses a type the gguf package cannot dequantize).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from lamina.models.weight_formats import FormatChoice
from lamina.models.weight_formats.gguf_blocks import BLOCKS, Q4_TYPES, SUPPORTED, pack_rows, row_bytes
from lamina.models.weight_formats.int4_groups import GroupQuantFormat


def layout_for(types: Mapping[str, T]) -> tuple[int, int]:
    """(bits, group) that holds every part's blocks."""
    bits = 4 if all(t in Q4_TYPES for t in types.values()) else 8
    return bits, min(BLOCKS[t][2] for t in types.values())


class GGUFFormat(GroupQuantFormat):
    """types: the GGUF block type of each part ("" for an unfused layer); the loader takes the part's raw
    bytes, uint8 [rows, bytes per row]."""

    def __init__(self, types: Mapping[str, T]) -> None:
        self.types = dict(types)
        super().__init__(*layout_for(self.types))

    def __repr__(self) -> str:
        kinds = sorted({t.name for t in self.types.values()})
        return f"GGUFFormat({'/'.join(kinds)} -> int{self.bits}, group={self.group})"

    def convert(self, layer: nn.Module, shard: str, tensor: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        qtype = self.types.get(shard)
        if qtype is None:
            raise ValueError(f"no GGUF type recorded for part {shard!r}")
        k = layer.in_features
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != (rows, row_bytes(qtype, k)):
            raise ValueError(f"expects {qtype.name} blocks uint8 {(rows, row_bytes(qtype, k))}, the checkpoint "
                             f"has {tensor.dtype} {tuple(tensor.shape)}")
        return pack_rows(tensor.cpu(), qtype, k, self.bits, self.group)

    def tp_slice(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: str | None, cut) -> torch.Tensor:
        """Rows (column parallel) are whole; a row split keeps whole blocks: a Q4_K/Q6_K super-block is 256
        input features, Q8_0/Q4_0/Q4_1 blocks 32."""
        what = f"{name} of shard {shard!r}" if shard else name
        if cut.dim == 0:
            return cut.along(tensor, 0, what=what)
        if name == "bias":
            return tensor
        per, size, _ = BLOCKS[self.types[shard or ""]]
        return cut.along(tensor, 1, per, size, what=f"{what} ({self.types[shard or ''].name} blocks)")


@dataclass
class GGUFPlan:
    """choose: the format of each layer kept quantized; packed: the GGUF tensor names loaded as raw blocks."""

    choose: FormatChoice
    packed: frozenset[str]


def plan_gguf(tensors: Mapping[str, T], hf_name, checkpoint_map, tie_embeddings: bool) -> GGUFPlan:
    """tensors: GGUF tensor name -> block type; hf_name: GGUF name -> HF name; checkpoint_map: the family's
    map from an HF name to our targets (parameter, shard)."""
    probe = torch.empty(0, device="meta")
    layers: dict[str, dict[str, T]] = {}
    sources: dict[str, list[str]] = {}
    floats: set[str] = set()
    for gname, qtype in tensors.items():
        if not gname.endswith(".weight"):
            continue
        for target, _ in checkpoint_map(hf_name(gname), probe):
            layer, _, pname = target.param.rpartition(".")
            if pname != "weight" or target.expert is not None:
                continue
            if qtype in SUPPORTED:
                layers.setdefault(layer, {})[target.shard or ""] = qtype
                sources.setdefault(layer, []).append(gname)
            else:
                floats.add(layer)
    for layer in floats:
        layers.pop(layer, None)
        sources.pop(layer, None)
    if tie_embeddings and "model.embed_tokens" in layers:
        layers["lm_head"] = layers["model.embed_tokens"]

    def choose(name: str, module: nn.Module) -> GGUFFormat | None:
        types = layers.get(name)
        if types is None or set(types) != set(module.out_shards):
            return None  # not every part is kept quantized: dense
        return GGUFFormat(types)

    kept = {g for layer, names in sources.items() for g in names}
    return GGUFPlan(choose, frozenset(kept))
