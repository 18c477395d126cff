"""Maps an HF `architectures` entry (or a GGUF `general.architecture`) to the family that builds its config."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lamina.models.config import ModelConfig
from lamina.models.families import bamba, common, deepseek, gemma, llama, nemotron_h, qwen3_moe, qwen3_next
from lamina.models.weights import CheckpointMap

_FAMILIES = {arch: (fam, llama.config_from_hf) for arch, fam in llama.ARCHITECTURES.items()}
_FAMILIES.update({arch: (fam, qwen3_moe.config_from_hf) for arch, fam in qwen3_moe.ARCHITECTURES.items()})
_FAMILIES.update({arch: (fam, qwen3_next.config_from_hf) for arch, fam in qwen3_next.ARCHITECTURES.items()})
_FAMILIES.update({arch: (fam, gemma.config_from_hf) for arch, fam in gemma.ARCHITECTURES.items()})
_FAMILIES.update({arch: (fam, nemotron_h.config_from_hf) for arch, fam in nemotron_h.ARCHITECTURES.items()})
_FAMILIES.update({arch: (fam, bamba.config_from_hf) for arch, fam in bamba.ARCHITECTURES.items()})
_FAMILIES.update({arch: (fam, deepseek.config_from_hf) for arch, fam in deepseek.ARCHITECTURES.items()})
# Families whose checkpoint names need more than families/common.py's HF rules: family -> (cfg -> map).
_CHECKPOINT_MAPS: dict[str, Callable[[ModelConfig], CheckpointMap]] = {
    fam: qwen3_next.checkpoint_map for fam in set(qwen3_next.ARCHITECTURES.values())}
_CHECKPOINT_MAPS.update({fam: gemma.checkpoint_map for fam in set(gemma.ARCHITECTURES.values())})
_CHECKPOINT_MAPS.update({"nemotron_h": nemotron_h.checkpoint_map, "bamba": bamba.checkpoint_map})
_CHECKPOINT_MAPS.update({fam: deepseek.checkpoint_map for fam in set(deepseek.ARCHITECTURES.values())})
# GGUF architecture names -> HF architecture names.
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in _FAMILIES:
            family, build = _FAMILIES[arch]
            cfg = build(family, hf)
            cfg.quantization_config = hf.get("quantization_config") or None
            return cfg
    raise ValueError(
        f"unsupported model architecture {archs or hf.get('model_type')!r}; "
        f"lamina supports {', '.join(supported_architectures())}"
    )


def checkpoint_map_for(cfg: ModelConfig) -> CheckpointMap:
    """The family's map from checkpoint tensors to parameter targets, for weights.load_weights."""
    return _CHECKPOINT_MAPS.get(cfg.family, common.checkpoint_map)(cfg)
