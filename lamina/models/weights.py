"""Puts checkpoint tensors (HF names) into the model's parameters, one tensor at a time.

Each tensor is converted straight to the parameter's dtype and device and copied in place, so a checkpoint
is never held twice in host memory.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable

import torch
from torch import nn

from lamina.models.layers.linear import MergedLinear

# A family's hook from one checkpoint tensor to zero or more (HF-style name, tensor) pairs: renames
# (prefixes, module names), skips (vision tower, MTP head), splits of fused tensors.
WeightMap = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]

# Checkpoint module name -> (our merged module name, shard).
STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    # Gated delta net input projections (Qwen3.5 names; Qwen3-Next's are split into these at load time).
    "in_proj_qkv": ("in_proj", "qkv"),
    "in_proj_z": ("in_proj", "z"),
    "in_proj_b": ("in_proj", "b"),
    "in_proj_a": ("in_proj", "a"),
}
# One routed expert's projection -> the stacked experts tensor (shard "N.gate", "N.up" or "N").
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _target(name: str) -> tuple[str, str | None]:
    """(our parameter name, shard or None) for a checkpoint tensor name."""
    if m := _EXPERT.match(name):
        prefix, expert, proj = m.groups()
        if proj == "down_proj":
            return f"{prefix}.down_proj", expert
        return f"{prefix}.gate_up_proj", f"{expert}.{proj.removesuffix('_proj')}"
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2] in STACKED:
        merged, shard = STACKED[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), shard
    return name, None


def _shard_names(module: nn.Module, param_name: str) -> list[str] | None:
    """The shards a parameter is loaded as (None: one whole tensor)."""
    if isinstance(module, MergedLinear):
        return list(module.shard_slices)
    expected = getattr(module, "expected_shards", None)
    return expected(param_name) if expected is not None else None


def _remapped(tensors: Iterable[tuple[str, torch.Tensor]], hook: WeightMap | None):
    for name, tensor in tensors:
        yield from (hook(name, tensor) if hook is not None else ((name, tensor),))


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                 weight_map: WeightMap | None = None) -> None:
    """weight_map: the family's name hook (default: the registry's for model.config)."""
    if weight_map is None:
        from lamina.models.registry import weight_map_for

        weight_map = weight_map_for(model.config)
    tensors = _remapped(tensors, weight_map)
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
            module_name, param_name = target.rsplit(".", 1)
            # A whole stacked tensor (e.g. all experts at once) fills every shard it is expected as.
            loaded |= {f"{target}:{s}" for s in _shard_names(modules[module_name], param_name) or []}
        else:
            module_name, param_name = target.rsplit(".", 1)
            module = modules[module_name]
            assert hasattr(module, "load_shard"), f"{name}: {module_name} cannot load shards"
            module.load_shard(param_name, shard, tensor)
            loaded.add(f"{target}:{shard}")
    expected = set()
    for pname in params:
        module_name, param_name = pname.rsplit(".", 1)
        shards = _shard_names(modules[module_name], param_name)
        if shards is not None:
            expected |= {f"{pname}:{s}" for s in shards}
        else:
            expected.add(pname)
    if tied:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
