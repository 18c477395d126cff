"""Llama-style families: Llama (incl. llama3 rope scaling), Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral
(sliding window). They differ only in config fields; the layer modules and the loop are shared."""
from __future__ import annotations

from typing import Any

from lamina.models.config import LayerSpec, ModelConfig, eos_list, rope_params

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}


def _sliding_window(family: str, hf: dict[str, Any], layer: int) -> int | None:
    if family == "mistral":
        return hf.get("sliding_window")
    if family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        types = hf.get("layer_types")
        if types:
            return hf["sliding_window"] if types[layer] == "sliding_attention" else None
        return hf["sliding_window"] if layer >= hf.get("max_window_layers", 0) else None
    return None


def config_from_hf(family: str, hf: dict[str, Any]) -> ModelConfig:
    theta, scaling = rope_params(hf)
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    n_layers = hf["num_hidden_layers"]
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        layers=[LayerSpec("attention", "dense", _sliding_window(family, hf, i)) for i in range(n_layers)],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", family == "qwen2")),
        qk_norm=family == "qwen3",
        hidden_act=hf.get("hidden_act", "silu"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_list(hf.get("eos_token_id")),
        torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
    )
