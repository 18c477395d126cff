"""The attention prep (q/k RMSNorm + RoPE + KV store, attention_prep.py) folded into the decode attention
kernel: at batch 1 the attention block between its projections is three short launches (prep, split decode
attention, combine) of ~3-4 us each, mostly launch and ramp; folding the prep into the decode kernel drops
one (each program normalizes and rotates its own query rows; the split holding the new token stores its K/V
first). The reference is the two ops it replaces, qk_norm_rope_store_ref then paged_attention_ref.

Opt-in (LAMINA_FUSED_ATTN_PREP=1, read per call) until timed on a GPU; taken only for decode-only batches
(the CUDA graphs' decode keys, eager decode steps) with the new decode kernel.
"""
from __future__ import annotations

import os

import torch

from lamina.kernels.attention_launch import launch_of
from lamina.kernels.dispatch import use_triton

ENV_SWITCH = "LAMINA_FUSED_ATTN_PREP"


def applies(q: torch.Tensor, meta) -> bool:
    """Switched on, a Triton tensor, a decode-only plan and the new decode kernel."""
    if os.environ.get(ENV_SWITCH) != "1" or not use_triton(q) or os.environ.get("LAMINA_DECODE_ATTN", "new") != "new":
        return False
    plan = launch_of(meta)
    return plan.decode and not plan.prefill


def prep_attention_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta, scale, sliding_window=None,
                       softcap=None, q_weight=None, k_weight=None, eps=1e-6, offset=0.0) -> torch.Tensor:
    from lamina.kernels.attention import paged_attention_ref
    from lamina.kernels.attention_prep import qk_norm_rope_store_ref

    qn = qk_norm_rope_store_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping, q_weight,
                                k_weight, eps, offset)
    return paged_attention_ref(qn, k_cache, v_cache, meta, scale, sliding_window, softcap)


def prep_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta, scale, sliding_window=None,
                   softcap=None, q_weight=None, k_weight=None, eps=1e-6, offset=0.0, *,
                   num_splits: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, Dv] (raw projection views); writes the new K/V to the caches
    at meta.slot_mapping and returns attention's [T, Hq, Dv], as prep_attention_ref does."""
    from lamina.kernels.triton_attention import paged_attention_triton

    assert (q_weight is None) == (k_weight is None)
    prep = (k, v, positions, cos_sin_cache, meta.slot_mapping, q_weight, k_weight, eps, offset)
    return paged_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window, softcap=softcap,
                                  num_splits=num_splits, decode_variant="new", prep=prep)
