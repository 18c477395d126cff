"""Maps an HF `architectures` entry (or a GGUF `general.architecture`) to the family that builds its config."""
from __future__ import annotations

from typing import Any, Callable

from lamina.models.config import ModelConfig
from lamina.models.families import llama, qwen3_moe, qwen3_next

_FAMILIES = {arch: (fam, llama.config_from_hf) for arch, fam in llama.ARCHITECTURES.items()}
_FAMILIES.update({arch: (fam, qwen3_moe.config_from_hf) for arch, fam in qwen3_moe.ARCHITECTURES.items()})
_FAMILIES.update({arch: (fam, qwen3_next.config_from_hf) for arch, fam in qwen3_next.ARCHITECTURES.items()})
# Families whose checkpoint names need more than weights.py's generic rules: family -> (cfg -> name hook).
_WEIGHT_MAPS: dict[str, Callable[[ModelConfig], Any]] = {
    fam: qwen3_next.weight_map for fam in set(qwen3_next.ARCHITECTURES.values())}
# GGUF architecture names -> HF architecture names.
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mistral": "MistralForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in _FAMILIES:
            family, build = _FAMILIES[arch]
            return build(family, hf)
    raise ValueError(
        f"unsupported model architecture {archs or hf.get('model_type')!r}; "
        f"lamina supports {', '.join(supported_architectures())}"
    )


def weight_map_for(cfg: ModelConfig):
    """The family's checkpoint-name hook for weights.load_weights, or None (names map as they are)."""
    build = _WEIGHT_MAPS.get(cfg.family)
    return build(cfg) if build is not None else None
