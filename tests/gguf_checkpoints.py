"""A tiny llama-architecture GGUF written with the gguf package's own writer and quantizer: random weights in
one block type (Q8_0, Q4_0, Q4_1: blocks of 32, so the 64-wide tiny shapes hold whole blocks), float norms, a
tied embedding in the same type. No tokenizer: engines on it run with skip_tokenizer_init and token ids."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize


def write_tiny_llama_gguf(path: Path, qtype: T = T.Q8_0, vocab: int = 4096, hidden: int = 64, heads: int = 4,
                          kv_heads: int = 2, head_dim: int = 32, inter: int = 128, layers: int = 2,
                          seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("embedding_length", hidden), ("block_count", layers), ("feed_forward_length", inter),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                       ("context_length", 512), ("vocab_size", vocab)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)

    def packed(name: str, rows: int, cols: int, scale: float = 0.1) -> None:
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    packed("token_embd.weight", vocab, hidden, 0.5)
    norm("output_norm.weight")
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        for name, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                                 ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            packed(f"{p}{name}.weight", rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
