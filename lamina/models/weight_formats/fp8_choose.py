"""Which layers get FP8 formats: for quant_method "fp8" checkpoints and for online quantization.

Layers are matched by their checkpoint names (a fused qkv_proj answers for q_proj, k_proj and v_proj), so an
`ignore` / `modules_to_not_convert` list written against the checkpoint applies as written. A fused layer
whose shards are treated differently is refused (one weight format per layer).

Quantized: the decoder layers' projections and routed experts. Kept dense: embeddings, lm_head, the MoE
router (`mlp.gate`) and the shared expert's gate (tiny, and routing is sensitive), and whatever the
checkpoint's config lists as not converted.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import nn

from lamina.models.weight_formats.fp8 import Fp8Linear, Fp8Scheme, check_block
from lamina.models.weight_formats.fp8_experts import Fp8Experts

_DENSE_SUFFIXES = (".mlp.gate", ".shared_expert_gate")


def checkpoint_names(name: str, layer: nn.Module) -> list[str]:
    """The checkpoint module names a layer of ours loads from (families/common.py's fusing, inverted)."""
    from lamina.models.families.common import FUSED

    if hasattr(layer, "num_experts") and hasattr(layer, "intermediate"):  # FusedExperts
        return [f"{name}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    parent, _, own = name.rpartition(".")
    shards = [s for s in getattr(layer, "out_shards", {}) if s]
    if not shards:
        return [name]
    by_part = {(fused, shard): hf for hf, (fused, shard) in FUSED.items()}
    names = [by_part.get((own, s)) for s in shards]
    if None in names:
        return [name]
    return [f"{parent}.{n}" if parent else n for n in names]


def matches(pattern: str, name: str) -> bool:
    """compressed-tensors style: "re:REGEX" (re.match) or a module name (the name or a parent of it)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern)


def decide_all(names: Iterable[str], predicate, layer_name: str) -> bool:
    """predicate over every checkpoint name of one layer: all True, all False, or a refusal."""
    answers = {bool(predicate(n)) for n in names}
    if len(answers) > 1:
        raise ValueError(f"the checkpoint quantizes only some parts of the fused layer {layer_name}; lamina "
                         f"needs one format per fused layer")
    return answers.pop()


def default_quantized(name: str, layer: nn.Module) -> bool:
    return name.startswith("model.layers.") and not name.endswith(_DENSE_SUFFIXES) and hasattr(layer, "set_format")


def fp8_format(scheme: Fp8Scheme, layer: nn.Module):
    return Fp8Experts(scheme) if hasattr(layer, "num_experts") and hasattr(layer, "intermediate") else \
        Fp8Linear(scheme)


def choose_fp8(quant_config: dict[str, Any], model_config: Any):
    """quant_method "fp8": e4m3 weights with `weight_block_size` [bn, bk] block scales (weight_scale_inv;
    dynamic activations), or without it per-tensor `weight_scale` (+ `input_scale` when
    activation_scheme is "static")."""
    fmt = str(quant_config.get("fmt", "e4m3")).lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ValueError(f"unsupported FP8 format {fmt!r} of quant_method 'fp8'; supported: e4m3")
    act = str(quant_config.get("activation_scheme", "dynamic")).lower()
    if act not in ("dynamic", "static"):
        raise ValueError(f"unsupported activation_scheme {act!r} of quant_method 'fp8'; supported: dynamic, static")
    block = quant_config.get("weight_block_size")
    if block is not None:
        if act != "dynamic":
            raise ValueError("quant_method 'fp8' with weight_block_size supports activation_scheme 'dynamic' only")
        scheme = Fp8Scheme(block=check_block(block), scale_name="weight_scale_inv")
    else:
        scheme = Fp8Scheme(block=None, scale_name="weight_scale", static_input=act == "static")
    ignore = list(quant_config.get("modules_to_not_convert") or quant_config.get("ignored_layers") or [])

    def choose(name: str, layer: nn.Module):
        if not default_quantized(name, layer):
            return None
        names = checkpoint_names(name, layer)
        if decide_all(names, lambda n: any(matches(p, n) for p in ignore), name):
            return None
        return fp8_format(scheme, layer)

    return choose


ONLINE_METHODS = ("fp8",)


def online_chooser(method: str):
    """--quantization fp8: dense (bf16/fp16/fp32 or GGUF) checkpoints quantized to FP8 with row scales."""
    if method not in ONLINE_METHODS:
        raise ValueError(f"unsupported online quantization {method!r}; supported: {', '.join(ONLINE_METHODS)}")
    scheme = Fp8Scheme(online=True)

    def choose(name: str, layer: nn.Module):
        return fp8_format(scheme, layer) if default_quantized(name, layer) else None

    return choose
