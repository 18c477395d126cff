"""Puts checkpoint tensors (HF names) into the model's parameters, one tensor at a time.

Each tensor is converted straight to the parameter's dtype and device and copied in place, so a checkpoint
is never held twice in host memory.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from lamina.models.layers.linear import MergedLinear

# Checkpoint module name -> (our merged module name, shard).
STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _target(name: str) -> tuple[str, str | None]:
    """(our parameter name, shard or None) for a checkpoint tensor name."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2] in STACKED:
        merged, shard = STACKED[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), shard
    return name, None


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor in tensors:
        if name.startswith("lm_head.") and tied:
            continue  # tied checkpoints may still carry a copy
        if "rotary_emb.inv_freq" in name:
            continue
        target, shard = _target(name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        param = params[target]
        if shard is None:
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(target)
        else:
            module_name, param_name = target.rsplit(".", 1)
            module = modules[module_name]
            assert isinstance(module, MergedLinear)
            module.load_shard(param_name, shard, tensor)
            loaded.add(f"{target}:{shard}")
    expected = set()
    for pname in params:
        module_name, param_name = pname.rsplit(".", 1)
        module = modules[module_name]
        if isinstance(module, MergedLinear):
            expected |= {f"{pname}:{s}" for s in module.shard_slices}
        else:
            expected.add(pname)
    if tied:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
