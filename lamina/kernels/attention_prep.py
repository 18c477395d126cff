"""What an attention layer does to q/k/v between its projection and attention: optional per-head q/k RMSNorm,
RoPE on q and k, and the store of this step's k and v into the paged KV pool, as one op.

The reference composes the separate ops (rms_norm_ref, apply_rope_ref, store_kv_ref) and is the oracle;
CUDA tensors go to one Triton kernel (triton_attention_prep.py) instead of three to five launches.
"""
from __future__ import annotations

import torch

from lamina.kernels.attention import store_kv_ref
from lamina.kernels.dispatch import use_triton
from lamina.kernels.norm import rms_norm_ref
from lamina.kernels.rope import apply_rope_ref


def qk_norm_rope_store_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                           k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                           offset: float = 0.0) -> torch.Tensor:
    """q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, Dv] (views with any token/head strides). Returns the
    normalized, rotated q as a new [T, Hq, D] tensor; the normalized, rotated k and v are written to the
    caches ([num_blocks, block_size, Hkv, D]) at slot_mapping (slots < 0 are padding: nothing written).
    q_weight/k_weight None means the model has no q/k norm (both or neither)."""
    assert (q_weight is None) == (k_weight is None)
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps, offset), rms_norm_ref(k, k_weight, eps, offset)
    q, k = apply_rope_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                       k_weight: torch.Tensor | None = None, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """See qk_norm_rope_store_ref (same contract; k and v themselves are never modified)."""
    if use_triton(q):
        from lamina.kernels.triton_attention_prep import qk_norm_rope_store_triton

        return qk_norm_rope_store_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                         q_weight, k_weight, eps, offset)
    return qk_norm_rope_store_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                  q_weight, k_weight, eps, offset)
