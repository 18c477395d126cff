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
    return hf


def _hf_name(name: str) -> str:
    m = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
    if m:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
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
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # unquantized tensors are read-only views of the mmap
            arr = arr.copy()
        tensor = torch.from_numpy(arr)
        yield _hf_name(t.name), tensor.to(device=device) if raw else tensor.to(device=device, dtype=dtype)


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as e:  # numpy's view errors on a short or corrupt file
        from lamina.models.gguf_header import GGUFError

        raise GGUFError(f"{path}: corrupt or truncated GGUF file ({e})") from None
