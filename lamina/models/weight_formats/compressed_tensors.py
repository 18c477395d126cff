"""compressed-tensors checkpoints (quant_method "compressed-tensors"): the config's scheme groups -> formats.

The config lists `config_groups`, each with `targets` (layer class names such as "Linear", module names, or
"re:REGEX" patterns, all written against the checkpoint's module names), a `weights` spec (num_bits, type
"float" | "int", strategy "tensor" | "channel" | "block" | "group", group_size, block_structure, symmetric)
and an `input_activations` spec (dynamic per-token, static per-tensor, or none), plus a top-level `ignore`
list. Supported:
- FP8 e4m3 weights (8-bit float, symmetric; per tensor, per channel or per block) with dynamic per-token FP8
  activations, static per-tensor FP8 activations, or none (weight-only): weight_formats/fp8.py;
- int4 `pack-quantized` weights: lamina.models.weight_formats.int4_ct.choose_ct_int4 (imported only when a
  checkpoint asks for it).
Anything else is refused with one line before any weight is read.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lamina.models.weight_formats.fp8 import Fp8Scheme, check_block
from lamina.models.weight_formats.fp8_choose import checkpoint_names, decide_all, fp8_format, matches

SUPPORTED = ("FP8 e4m3 weights (strategy tensor, channel or block; symmetric) with dynamic per-token, static "
             "per-tensor or no FP8 activation quantization; int4 pack-quantized weights")
INT4_CHOOSER = "lamina.models.weight_formats.int4_ct:choose_ct_int4"


@dataclass(frozen=True)
class Group:
    name: str
    targets: tuple[str, ...]
    scheme: dict[str, Any]
    build: Callable[[str, nn.Module], Any]  # (layer name, layer) -> format


def _describe(weights: dict, acts: dict | None) -> str:
    w = f"{weights.get('type')} {weights.get('num_bits')}-bit weights, strategy {weights.get('strategy')}"
    a = "no activation quantization" if not acts else (
        f"{'dynamic' if acts.get('dynamic') else 'static'} {acts.get('type')} {acts.get('num_bits')}-bit "
        f"activations, strategy {acts.get('strategy')}")
    return f"{w}, {a}"


def fp8_scheme(weights: dict[str, Any], acts: dict[str, Any] | None) -> Fp8Scheme | None:
    """The Fp8Scheme of an FP8 weights/activations spec; None if the weights are not FP8."""
    if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
        return None
    refuse = f"unsupported compressed-tensors scheme ({_describe(weights, acts)}); supported: {SUPPORTED}"
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise ValueError(refuse)
    strategy = weights.get("strategy")
    static = False
    if acts:
        if acts.get("type") != "float" or int(acts.get("num_bits", 0)) != 8:
            raise ValueError(refuse)
        if acts.get("dynamic"):
            if acts.get("strategy") not in ("token", None):
                raise ValueError(refuse)
        elif acts.get("strategy") == "tensor":
            static = True
        else:
            raise ValueError(refuse)
    if strategy in ("tensor", "channel"):
        return Fp8Scheme(block=None, scale_name="weight_scale", static_input=static)
    if strategy == "block":
        if static:
            raise ValueError(refuse)
        return Fp8Scheme(block=check_block(weights.get("block_structure")), scale_name="weight_scale")
    raise ValueError(refuse)


def _group(name: str, group: dict[str, Any], fmt: str | None) -> Group:
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    targets = tuple(group.get("targets") or ())
    scheme = fp8_scheme(weights, acts)
    if scheme is not None:
        return Group(name, targets, group, lambda n, layer: fp8_format(scheme, layer))
    fmt = group.get("format", fmt)
    if weights.get("type") == "int" and int(weights.get("num_bits", 0)) == 4 and fmt == "pack-quantized":
        module, func = INT4_CHOOSER.split(":")
        try:
            chooser = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"compressed-tensors int4 pack-quantized weights need {INT4_CHOOSER}, which is not "
                             f"available ({e})") from None
        return Group(name, targets, group, lambda n, layer: chooser(group, n, layer))
    raise ValueError(f"unsupported compressed-tensors scheme {name!r} ({_describe(weights, acts)}, format "
                     f"{fmt!r}); supported: {SUPPORTED}")


def _targets(pattern: str, name: str, layer: nn.Module) -> bool:
    if pattern == "Linear":  # the checkpoint's nn.Linear modules: our Linear layers and expert projections
        return hasattr(layer, "set_format") and type(layer).__name__ in ("Linear", "FusedExperts")
    return matches(pattern, name)


def choose_ct(quant_config: dict[str, Any], model_config: Any):
    """The FormatChoice of a compressed-tensors config (validates every group up front)."""
    fmt = quant_config.get("format")
    groups = [_group(n, g, fmt) for n, g in (quant_config.get("config_groups") or {}).items()]
    if not groups:
        raise ValueError("compressed-tensors config has no config_groups")
    ignore = list(quant_config.get("ignore") or [])

    tied = bool(getattr(model_config, "tie_word_embeddings", False))

    def choose(name: str, layer: nn.Module):
        if not hasattr(layer, "set_format") or type(layer).__name__ == "Embedding":
            return None
        if tied and name == "lm_head":  # a tied lm_head reads the (dense) embedding table
            return None
        names = checkpoint_names(name, layer)
        if decide_all(names, lambda n: any(matches(p, n) for p in ignore), name):
            return None
        for g in groups:
            if decide_all(names, lambda n, g=g: any(_targets(t, n, layer) for t in g.targets), name):
                return g.build(name, layer)
        return None

    return choose
