"""Multi-head latent attention over the paged latent cache: the latent store and the absorbed-form decode.

The cache holds one row per token, [kv_lora_rank latent c | qk_rope_head_dim rotated rope key k_pe], shared
by every head (cache/specs.py LatentAttentionSpec: [num_blocks, block_size, kv_lora_rank + rope_dim]). Decode
runs in the absorbed form: each head's query is moved into latent space beforehand (q_lat = q_nope W_UK), so
a score is q_lat . c + q_pe . k_pe and the output stays in latent space (sum_j p_j c_j), to be lifted by W_UV
afterwards (layers/mla.py). Like MQA with one K/V "head" of width kv_lora_rank + rope_dim whose value is its
first kv_lora_rank columns.

Contract shared by the reference and the Triton kernel: sequence b owns row b of q_lat/q_pe and attends to
its first seq_lens[b] cached tokens (this step's included: store first) through block_tables[b]; a sequence
with seq_len 0 is padding (CUDA-graph rows): its output is zeros and no cache row is read.
An FP8 (e4m3) cache (--kv-cache-dtype fp8) stores the rows saturated at +-448, scale 1 (the latent is
RMS-normed, so its entries are O(1)); readers widen it to the query's dtype.
"""
from __future__ import annotations

import torch

from lamina.kernels.attention import _index_copy, to_cache_dtype
from lamina.kernels.dispatch import use_triton


def store_latent_ref(latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """latent [T, C], k_pe [T, R] -> cache rows slot_mapping ([num_blocks, block_size, C + R]); slots < 0 skip."""
    flat = cache.view(-1, cache.shape[-1])
    rows = to_cache_dtype(torch.cat([latent, k_pe], dim=-1), cache.dtype)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        rows, slot_mapping = rows[valid], slot_mapping[valid]
    _index_copy(flat, slot_mapping.long(), rows)


def _rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] (torch has no CPU gather for float8: the bytes are gathered)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[index].view(cache.dtype)
    return cache[index]


def store_latent(latent, k_pe, cache, slot_mapping) -> None:
    if use_triton(latent):
        from lamina.kernels.triton_mla_decode import store_latent_triton

        return store_latent_triton(latent, k_pe, cache, slot_mapping)
    return store_latent_ref(latent, k_pe, cache, slot_mapping)


def gather_latent(cache: torch.Tensor, block_table: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """The first n_tokens cache rows of one sequence, [n_tokens, C + R], through its block-table row."""
    bs = cache.shape[1]
    n_blocks = (n_tokens + bs - 1) // bs
    return _rows(cache, block_table[:n_blocks].long()).flatten(0, 1)[:n_tokens]


def mla_decode_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, seq_lens_cpu: list[int] | None = None) -> torch.Tensor:
    """q_lat [B, H, C], q_pe [B, H, R] -> latent-space output [B, H, C] (q_lat's dtype), fp32 math.

    One batched gather over the longest context; keys past a sequence's length are masked."""
    b, h, c = q_lat.shape
    lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    out = torch.zeros(b, h, c, dtype=q_lat.dtype, device=q_lat.device)
    if b == 0 or max(lens, default=0) == 0:
        return out
    bs = cache.shape[1]
    n_blocks = (max(lens) + bs - 1) // bs
    kv = _rows(cache, block_tables[:, :n_blocks].long()).flatten(1, 2).float()  # [B, S, C + R]
    key_pos = torch.arange(kv.shape[1], device=q_lat.device)
    mask = key_pos[None, :] < torch.tensor(lens, device=q_lat.device)[:, None]  # [B, S]
    kv = kv.masked_fill(~mask[..., None], 0.0)  # rows past a sequence may hold anything (stale, other data)
    scores = (torch.einsum("bhc,bsc->bhs", q_lat.float(), kv[..., :c])
              + torch.einsum("bhr,bsr->bhs", q_pe.float(), kv[..., c:])) * scale
    p = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhs,bsc->bhc", p, kv[..., :c]).to(q_lat.dtype)


def mla_decode(q_lat, q_pe, cache, block_tables, seq_lens, scale: float,
               seq_lens_cpu: list[int] | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA (reads only device tensors; max_seq_len, a host bound, sizes its
    split count), else the reference."""
    if use_triton(q_lat):
        from lamina.kernels.triton_mla_decode import mla_decode_triton

        return mla_decode_triton(q_lat, q_pe, cache, block_tables, seq_lens, scale, max_seq_len)
    return mla_decode_ref(q_lat, q_pe, cache, block_tables, seq_lens, scale, seq_lens_cpu)
