"""Which weight format each layer gets: from the checkpoint's `quantization_config`, or an online method.

One table maps a quantization method to the function that turns its config into a FormatChoice (see
weight_formats/__init__.py); each format family lives in its own module under weight_formats/ and is
imported only when a checkpoint asks for it. An unknown method is refused with one line listing the
supported ones (the loader raises it before any weight is read).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from lamina.models.weight_formats import FormatChoice

# method -> "module:function"; the function takes (quantization_config dict, ModelConfig) and returns a
# FormatChoice. Entries are added by the format modules' authors (FP8 blocks, compressed-tensors, GPTQ, AWQ).
CHOOSERS: Mapping[str, str] = {
    "fp8": "lamina.models.weight_formats.fp8_choose:choose_fp8",
    "compressed-tensors": "lamina.models.weight_formats.compressed_tensors:choose_ct",
    "gptq": "lamina.models.weight_formats.int4_gptq:choose_gptq",
    "awq": "lamina.models.weight_formats.int4_gptq:choose_awq",
}

ChooserFactory = Callable[[dict[str, Any], Any], FormatChoice]


def supported_methods() -> list[str]:
    return sorted(CHOOSERS)


def format_chooser(quant_config: dict[str, Any] | None, model_config: Any,
                   online: str | None = None) -> FormatChoice | None:
    """The FormatChoice for a checkpoint's quantization config, or for `online` quantization of a dense
    checkpoint (--quantization; None: dense everywhere). A quantized checkpoint with a different online
    method is refused (its weights are already quantized one way)."""
    if online is not None:
        method = str((quant_config or {}).get("quant_method", "")).lower()
        if quant_config and method != online:
            raise ValueError(f"the checkpoint is already quantized ({method!r}); drop --quantization {online}")
        if not quant_config:
            from lamina.models.weight_formats.fp8_choose import online_chooser

            return online_chooser(online)
    if not quant_config:
        return None
    method = str(quant_config.get("quant_method", "")).lower()
    if method not in CHOOSERS:
        raise ValueError(f"unsupported quantization method {method!r}; supported: "
                         f"{', '.join(supported_methods()) or 'none'}")
    module, func = CHOOSERS[method].split(":")
    factory: ChooserFactory = getattr(importlib.import_module(module), func)
    return factory(quant_config, model_config)
