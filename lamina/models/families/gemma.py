"""Gemma 2 and Gemma 3 (text models, and the language model of Gemma 3's multimodal checkpoints).

Both use the sandwich decoder layer (layers/sandwich_decoder.py: norms before and after attention and the
FFN), zero-centred RMSNorm weights ((1 + w), norm_offset 1.0), GeGLU with tanh GELU, embeddings scaled by
sqrt(hidden_size), the attention scale query_pre_attn_scalar**-0.5, and interleaved sliding-window and
global attention layers (config `layer_types`; Gemma 2 alternates, Gemma 3 puts a global layer every
`sliding_window_pattern`-th). Where they differ:
  - Gemma 2: tanh soft-capping of the attention scores and of the final logits; one RoPE base.
  - Gemma 3: q/k norm; sliding layers rotate with their own base (rope_local_base_freq, or
    rope_parameters["sliding_attention"] in transformers 5) and global layers with theirs (rope_theta, or
    rope_parameters["full_attention"], possibly linearly scaled).
Multimodal Gemma 3 checkpoints keep the language model under language_model.model.* (or
model.language_model.*) next to a vision tower and projector, which are skipped.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lamina.models.config import LayerSpec, ModelConfig, eos_list, rope_params
from lamina.models.families.common import hf_targets
from lamina.models.weights import CheckpointMap, Target

ARCHITECTURES = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
}
# HF's defaults for fields a config.json may leave out (multimodal text_configs are often partial).
_DEFAULTS = {
    "gemma2": dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, rope_theta=10000.0,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0, max_position_embeddings=8192,
                   num_attention_heads=8, num_key_value_heads=4, vocab_size=256000),
    "gemma3": dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1_000_000.0,
                   rope_local_base_freq=10_000.0, sliding_window_pattern=6, max_position_embeddings=131072,
                   num_attention_heads=8, num_key_value_heads=4, vocab_size=262208),
}
_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")
_RENAMED_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                     ("language_model.lm_head.", "lm_head."))


def _layer_types(family: str, hf: dict[str, Any]) -> list[str]:
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    period = 2 if family == "gemma2" else hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]


def _gemma3_ropes(hf: dict[str, Any]) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((local theta, scaling), (global theta, scaling)) from either config layout."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        out = []
        for kind, default in (("sliding_attention", 10_000.0), ("full_attention", 1_000_000.0)):
            p = dict(params.get(kind) or {})
            theta = float(p.get("rope_theta", default))
            scaling = p if p.get("rope_type", "default") != "default" else None
            out.append((theta, scaling))
        return out[0], out[1]
    theta, scaling = rope_params(hf)
    return (float(hf.get("rope_local_base_freq", 10_000.0)), None), (theta, scaling)


def config_from_hf(family: str, hf: dict[str, Any]) -> ModelConfig:
    # A null field takes HF's default, except the soft-caps, where null means off.
    given = {k: v for k, v in hf.items() if v is not None or k.endswith("_softcapping")}
    hf = {**_DEFAULTS["gemma2" if family == "gemma2" else "gemma3"], **given}
    if hf.get("use_bidirectional_attention"):
        raise ValueError("bidirectional Gemma 3 (embedding models) is not a causal LM; lamina cannot run it")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    window = hf["sliding_window"]
    if family == "gemma2":
        theta, scaling = rope_params(hf)
        local = glob = (theta, scaling)
    else:
        local, glob = _gemma3_ropes(hf)
    layers = []
    for kind in _layer_types(family, hf):
        sliding = kind == "sliding_attention"
        theta, scaling = local if sliding else glob
        layers.append(LayerSpec("attention", "dense", window if sliding else None, rope_theta=theta,
                                rope_scaling=scaling))
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        layers=layers,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=glob[0],
        rope_scaling=glob[1],
        max_position_embeddings=hf["max_position_embeddings"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=family != "gemma2",
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_list(hf.get("eos_token_id")),
        torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=hidden**0.5,
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
        attn_logit_softcap=hf.get("attn_logit_softcapping") or None,
        final_logit_softcap=hf.get("final_logit_softcapping") or None,
    )


def checkpoint_map(cfg: ModelConfig) -> CheckpointMap:
    """HF names, with a multimodal checkpoint's language model moved to the top and its vision parts skipped."""

    def targets(name: str, tensor: torch.Tensor) -> Iterable[tuple[Target, torch.Tensor]]:
        if name.startswith(_SKIPPED_PREFIXES):
            return []
        for old, new in _RENAMED_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return hf_targets(name, tensor)

    return targets
