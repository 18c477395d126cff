"""Weight formats: how a layer's weights are stored, loaded and applied (see base.py for the contract).

To add a format (FP8 blocks, 4-bit groups, GGUF blocks kept packed, LoRA, a TP shard):
1. subclass WeightFormat (linear-shaped weights) and/or ExpertFormat (MoE expert stacks) in a module here;
   create_params registers the parameters it stores with a loader each (register_param), apply computes;
2. name its parameters after the checkpoint's (q_proj.weight_scale_inv -> qkv_proj.weight_scale_inv) so the
   family's checkpoint map routes them (fused shards and experts keep their names; families/common.py);
3. choose it per layer before the weights are materialized: loader.build_model's `choose_format`
   (assign_formats), `choose` reading the checkpoint's quantization config or the parallel layout.
The layers (Linear, Embedding, FusedExperts) and the modules using them stay as they are.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lamina.models.weight_formats.base import (
    ExpertFormat,
    Partition,
    WeightFormat,
    WeightLoader,
    param_spec,
    weight_loader,
)
from lamina.models.weight_formats.dense import DenseExperts, DenseFormat

__all__ = ["DenseExperts", "DenseFormat", "ExpertFormat", "FormatChoice", "Partition", "WeightFormat",
           "WeightLoader", "assign_formats", "param_spec", "weight_loader"]

# (qualified layer name, layer) -> the format it should use, or None to keep its current one.
FormatChoice = Callable[[str, nn.Module], "WeightFormat | ExpertFormat | None"]


def assign_formats(model: nn.Module, choose: FormatChoice, dtype: torch.dtype) -> int:
    """Gives each layer with a weight format the one `choose` picks (recreating its parameters; call on the
    meta device, before to_empty and tie_weights). Returns how many layers changed."""
    changed = 0
    for name, module in model.named_modules():
        if hasattr(module, "set_format"):
            fmt = choose(name, module)
            if fmt is not None:
                module.set_format(fmt, dtype)
                changed += 1
    return changed
