"""Routes checkpoint tensors into the model's parameters, one tensor at a time, through each parameter's
weight loader.

The family's checkpoint map (registry.checkpoint_map_for) turns one checkpoint tensor into zero or more
(Target, tensor) pairs: renames, skips (vision tower, MTP head), splits of tensors fused differently from
ours. A Target names one of our parameters and, for a fused projection or an expert stack, the part the
tensor fills (shard "q", expert 3, or both). The parameter's loader, which its weight format registered,
writes the tensor into its slice, converting dtype and device on the way (one copy_, so a checkpoint is
never held twice in host memory and a bf16 checkpoint never passes through fp32) and refusing a wrong
shape. After the last tensor every parameter part must have arrived, or loading fails naming what is missing.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lamina.models.weight_formats import param_spec
from lamina.models.weight_formats.base import part_key


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: our parameter's qualified name, and the part of it (None: whole)."""

    param: str
    shard: str | None = None
    expert: int | None = None

    def __str__(self) -> str:
        part = part_key(self.shard, self.expert)
        return f"{self.param}[{part}]" if part else self.param


# A family's map from one checkpoint tensor (name, tensor) to the (target, tensor) pairs it loads as.
CheckpointMap = Callable[[str, torch.Tensor], Iterable[tuple[Target, torch.Tensor]]]


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                 checkpoint_map: CheckpointMap | None = None) -> None:
    """checkpoint_map: the family's (default: the registry's for model.config)."""
    if checkpoint_map is None:
        from lamina.models.registry import checkpoint_map_for

        checkpoint_map = checkpoint_map_for(model.config)
    params = dict(model.named_parameters())  # a tied lm_head.weight is listed once, as the embedding
    modules = dict(model.named_modules())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[tuple[str, str]] = set()
    for name, tensor in tensors:
        for target, part in checkpoint_map(name, tensor):
            if tied and target.param.startswith("lm_head."):
                continue  # tied checkpoints may still carry a copy
            param = params.get(target.param)
            if param is None:
                where = "" if target.param == name else f" (mapped to {target.param})"
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model{where}")
            module_name, _, param_name = target.param.rpartition(".")
            module = modules[module_name]
            spec = param_spec(module, param_name)
            try:
                spec.loader(module, param, part, target.shard, target.expert)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} -> {target}: {e}") from None
            if target.shard is None and target.expert is None:
                loaded.update((target.param, p) for p in spec.parts or ("",))  # a whole (stacked) tensor
            else:
                loaded.add((target.param, part_key(target.shard, target.expert)))
    expected = {(pname, p) for pname in params for p in _parts(modules, pname) or ("",)}
    missing = sorted(expected - loaded)
    if missing:
        shown = [f"{n}[{p}]" if p else n for n, p in missing[:3]]
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {shown}")


def _parts(modules: dict[str, nn.Module], qualified: str) -> tuple[str, ...]:
    module_name, _, param_name = qualified.rpartition(".")
    return param_spec(modules[module_name], param_name).parts
