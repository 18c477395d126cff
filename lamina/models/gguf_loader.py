"""Reads a GGUF file: metadata -> an HF-shaped config dict, and tensors (dequantized) under HF names."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from lamina.models.registry import GGUF_ARCHS

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Gemma 2/3 (sandwich layers): llama.cpp's ffn_norm is the norm before the FFN, and two more follow the
# sublayers. Its converter stores Gemma's RMSNorm weights as (1 + w): _GEMMA_ARCHS' norms load as w - 1.
_GEMMA_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA_ARCHS = ("gemma2", "gemma3")


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config_from_gguf(reader: GGUFReader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHS)}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    hf = {
        "architectures": [GGUF_ARCHS[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv", heads),
        "head_dim": g("attention.key_length", hidden // heads),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g("rope.freq_base", 10000.0),
        "max_position_embeddings": g("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "sliding_window": g("attention.sliding_window"),
    }
    if arch in _GEMMA_ARCHS:
        hf.update(_gemma_fields(arch, g))
    return hf


def _gemma_fields(arch: str, g) -> dict[str, Any]:
    """What Gemma adds. GGUF has no local RoPE base, window pattern or query_pre_attn_scalar: llama.cpp and HF
    take Gemma 3's defaults (10000, every 6th layer global, 256) and so do we (gemma family defaults)."""
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma2":
        out["attn_logit_softcapping"] = g("attn_logit_softcapping", 50.0)
        out["final_logit_softcapping"] = g("final_logit_softcapping", 30.0)
    kind, factor = g("rope.scaling.type"), g("rope.scaling.factor")
    if kind == "linear" and factor and factor != 1.0:
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return out


def _hf_name(name: str, layer_names: dict[str, str] = _LAYER_NAMES) -> str:
    m = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
    if m:
        return f"model.layers.{m[1]}.{layer_names[m[2]]}.{m[3]}"
    base, kind = name.rsplit(".", 1)
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's convert-time permutation of Q/K rows (interleaved rope -> HF's half-split)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_plan(reader: GGUFReader, cfg: Any):
    """Which layers keep their GGUF blocks (weight_formats/gguf_format.py): the FormatChoice for
    build_model and the names of the tensors iter_gguf must hand over as raw blocks."""
    from lamina.models.registry import checkpoint_map_for
    from lamina.models.weight_formats.gguf_format import plan_gguf

    types = {t.name: t.tensor_type for t in reader.tensors}
    return plan_gguf(types, _hf_name, checkpoint_map_for(cfg), bool(cfg.tie_word_embeddings))


def _dequantized(t: Any) -> np.ndarray:
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data)
    try:
        return dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        from lamina.models.weight_formats.gguf_blocks import supported_names

        raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which lamina cannot load; "
                         f"kept quantized: {supported_names()}; dequantized: the other types the gguf "
                         "package reads") from None


def iter_gguf(reader: GGUFReader, hf: dict[str, Any], dtype: torch.dtype, device: torch.device,
              packed: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every GGUF tensor: dequantized to `dtype`, except the names in `packed`, which
    come as their raw blocks (uint8 [rows, bytes per row]) for the layer's GGUF weight format."""
    llama_like = hf["architectures"][0] in ("LlamaForCausalLM", "MistralForCausalLM")
    gemma = hf["architectures"][0] in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    layer_names = _GEMMA_NAMES if gemma else _LAYER_NAMES
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
        raw = t.name in packed
        if raw:
            arr = np.asarray(t.data)
            if arr.ndim != 2 or arr.shape[0] != shape[0]:
                raise ValueError(f"GGUF tensor {t.name!r}: blocks {arr.shape} do not match its shape {shape}")
        else:
            arr = _dequantized(t).reshape(shape)
        # Row permutations work on raw blocks too: a row is one output feature, its blocks run along K.
        if llama_like and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = _unpermute(arr, hf["num_attention_heads"])
        elif llama_like and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = _unpermute(arr, hf["num_key_value_heads"])
        if gemma and t.name.endswith("norm.weight"):
            arr = arr.astype(np.float32) - 1.0  # stored as (1 + w)
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # unquantized tensors are read-only views of the mmap
            arr = arr.copy()
        tensor = torch.from_numpy(arr)
        yield _hf_name(t.name, layer_names), tensor.to(device=device) if raw else tensor.to(device=device, dtype=dtype)


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as e:  # numpy's view errors on a short or corrupt file
        from lamina.models.gguf_header import GGUFError

        raise GGUFError(f"{path}: corrupt or truncated GGUF file ({e})") from None
