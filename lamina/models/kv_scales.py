"""KV-cache scales shipped by FP8 checkpoints, routed to their attention layers.

Checkpoints calibrated for an FP8 KV cache carry per-layer scalars: `self_attn.k_scale` / `v_scale`
(compressed-tensors' kv_cache_scheme, vLLM's convention), `self_attn.kv_scale` (one for both), or
`self_attn.k_proj.output_scale` / `v_proj.output_scale` (AutoFP8). They are not parameters of ours: this
wraps the family's checkpoint map, takes them out of the stream (after the family renamed them, so any
prefix works), and hands them to the layer (AttentionBase.set_kv_scales) once loading is done. They only
act when the KV pool is FP8; without them the scales are 1.0, as in vLLM.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from lamina.models.weights import CheckpointMap, Target

_SCALE = re.compile(r"^(.*)\.(k_scale|v_scale|kv_scale)$")
_OUTPUT = re.compile(r"^(.*)\.qkv_proj\.output_scale$")
_DROPPED = re.compile(r"^(.*)\.(q_scale|prob_scale)$")  # attention-input scales we do not use


class KVScales:
    """Collects the scales while a checkpoint streams through `wrap(map)`, then `apply(model)`."""

    def __init__(self) -> None:
        self.found: dict[str, dict[str, float]] = {}  # attention module name -> {"k": s, "v": s}

    def wrap(self, base: CheckpointMap) -> CheckpointMap:
        def mapped(name: str, tensor: torch.Tensor) -> Iterable[tuple[Target, torch.Tensor]]:
            out = []
            for target, part in base(name, tensor):
                if not self._take(target, part):
                    out.append((target, part))
            return out

        return mapped

    def _take(self, target: Target, tensor: torch.Tensor) -> bool:
        if _DROPPED.match(target.param):
            return True
        kind, m = None, _SCALE.match(target.param)
        if m:
            kind = {"k_scale": "k", "v_scale": "v", "kv_scale": "kv"}[m.group(2)]
        elif (m := _OUTPUT.match(target.param)) and target.shard in ("k", "v"):
            kind = target.shard
        elif _OUTPUT.match(target.param):
            return True  # q's output scale: unused
        if kind is None:
            return False
        if tensor.numel() != 1:
            raise ValueError(f"KV cache scale {target} must be one number, the checkpoint has shape "
                             f"{tuple(tensor.shape)}")
        value = float(tensor.float().reshape(()))
        entry = self.found.setdefault(m.group(1), {})
        for k in ("k", "v") if kind == "kv" else (kind,):
            entry[k] = value
        return True

    def apply(self, model: nn.Module) -> int:
        """Sets each attention layer's scales; returns how many layers got some."""
        modules = dict(model.named_modules())
        for name, entry in self.found.items():
            layer = modules.get(name)
            if layer is None or not hasattr(layer, "set_kv_scales"):
                raise ValueError(f"checkpoint KV cache scales for {name!r}, which is not an attention layer")
            layer.set_kv_scales(entry.get("k", 1.0), entry.get("v", 1.0))
        return len(self.found)
