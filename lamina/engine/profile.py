"""Measures the activation memory of a worst-case step, so the KV pool can take everything else."""
from __future__ import annotations

import torch

from lamina.cache.kv_cache import KVCache
from lamina.cache.state_layout import StateLayout
from lamina.engine.sampler import exponential_noise
from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.metadata import StepContext


@torch.inference_mode()
def profile_peak_bytes(model: torch.nn.Module, layout: StateLayout, max_tokens: int, max_rows: int,
                       block_size: int, device: torch.device) -> int:
    """Peak bytes above the weights for one prefill of max_tokens tokens that samples max_rows rows.

    The KV layers are bound to scratch blocks for the pass, then to empty views (zero blocks), so the scratch
    memory is free again when the caller sizes the real pool and binds it through the same StateLayout."""
    n_blocks = (max_tokens + block_size - 1) // block_size
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    scratch = KVCache(layout.kv_specs, n_blocks, block_size, device)
    layout.bind_kv(scratch.views)
    kv_bytes = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    t = max_tokens
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t, device=device),
        query_start=torch.tensor([0, t], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([t], dtype=torch.int32, device=device),
        block_tables=torch.arange(n_blocks, dtype=torch.int32, device=device)[None],
        query_start_cpu=[0, t], seq_lens_cpu=[t], max_query_len=t, max_seq_len=t)
    ids = torch.randint(0, model.config.vocab_size, (t,), device=device)
    rows = torch.arange(t - min(max_rows, t), t, device=device)
    logits = model(ids, torch.arange(t, device=device), StepContext(meta), rows)
    # The sampler's biggest temporaries: probabilities and the [rows, vocab] noise.
    probs = logits.softmax(dim=-1) / exponential_noise(torch.zeros(logits.shape[0], dtype=torch.int64,
                                                                   device=device), logits.shape[1])
    del probs, logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - kv_bytes
    layout.bind_kv(KVCache(layout.kv_specs, 0, block_size, device).views)
    del scratch
    torch.cuda.empty_cache()
    return peak
