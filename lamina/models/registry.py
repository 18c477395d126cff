"""Maps an HF `architectures` entry (or a GGUF `general.architecture`) to the family that builds its config."""
from __future__ import annotations

from typing import Any

from lamina.models.config import ModelConfig
from lamina.models.families import llama

_FAMILIES = {arch: (fam, llama.config_from_hf) for arch, fam in llama.ARCHITECTURES.items()}
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
