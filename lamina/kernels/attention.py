"""Paged attention over the KV pool: KV store, and attention for a flat varlen batch.

The batch is a flat list of tokens from several sequences (no padding). Sequence b owns query rows
[query_start[b], query_start[b+1]) and, after this step's K/V are stored, seq_lens[b] tokens of context in
the blocks its block table names; its queries sit at the last query_len positions of that context.
Decode is the special case query_len == 1 for every sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lamina.kernels.dispatch import use_triton


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one step's tokens sit in the KV pool and what each attends to; built once per step, never
    changed after (per-sequence recurrent-state addressing is StateMetadata's, lamina/kernels/metadata.py)."""

    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * block_size + offset) of each new token
    query_start: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # The torch reference's grouping and masks, derived once per step by whoever builds the metadata for the
    # reference path (the runner on the CPU); None: paged_attention_ref derives them per call.
    ref_plan: AttentionPlan | None = field(default=None, repr=False)
    # A model whose sliding-window layers keep a block pool of their own (cache/kv_groups.py): the same step
    # addressed in that pool (its own slot_mapping, block_tables and ref_plan; every other field equal).
    # Layers bound to that pool (KVBlocks.windowed) read this one; None for every other model.
    window: AttentionMetadata | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Slots < 0 are skipped (padding)."""
    kf, vf = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    _index_copy(kf, slot_mapping, to_cache_dtype(k, kf.dtype))
    _index_copy(vf, slot_mapping, to_cache_dtype(v, vf.dtype))


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype; into an FP8 cache (--kv-cache-dtype fp8, scale 1.0) saturating at +-448."""
    if dtype == torch.float8_e4m3fn:
        from lamina.kernels.fp8 import to_fp8

        return to_fp8(x.float())
    return x if x.dtype == dtype else x.to(dtype)


def _index_copy(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    if dst.dtype == torch.float8_e4m3fn:  # torch has no index_copy_ for float8 on the CPU: copy the bytes
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(0, index, src)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(k):
        from lamina.kernels.triton_attention import store_kv_triton

        return store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None = None) -> torch.Tensor:
    """q: [B, L, Hq, D]; k, v: [B, S, Hkv, D]; mask: [B, L, S] True = attend (None: every key; softcap needs
    one). fp32 math (the oracle).
    softcap: scores become cap * tanh(scores / cap) before the mask and softmax (Gemma 2).

    torch's SDPA with GQA: 2-2.5x faster on the CPU than einsum + softmax (measured on 32 x 1 x 256 and
    1 x 200 x 208 problems), same result to 1e-6."""
    if softcap is not None:
        return _attend_capped(q, k, v, mask, scale, softcap)
    f32 = [t if t.dtype == torch.float32 else t.float() for t in (q, k, v)]  # no no-op casts (~1 us each)
    out = F.scaled_dot_product_attention(f32[0].transpose(1, 2), f32[1].transpose(1, 2), f32[2].transpose(1, 2),
                                         attn_mask=None if mask is None else mask[:, None], scale=scale,
                                         enable_gqa=True).transpose(1, 2)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _attend_capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                   softcap: float) -> torch.Tensor:
    """_attend with soft-capped scores (SDPA has no hook between the scores and the softmax)."""
    g = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(g, dim=2)
    vf = v.float().repeat_interleave(g, dim=2)
    s = torch.einsum("blhd,bshd->bhls", q.float(), kf) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees no key (padding) gets zeros
    return torch.einsum("bhls,bshd->blhd", p, vf).to(q.dtype)


@dataclass(frozen=True)
class _Group:
    """Sequences attended together: all decode rows at once, or one prefill chunk."""

    q_rows: torch.Tensor  # [B*L] rows of q, sequence-major
    blocks: torch.Tensor  # [B, n] int64 block ids covering the longest context
    q_pos: torch.Tensor  # [B, L] position of each query row
    batch: int
    qlen: int
    block_size: int
    masks: tuple[tuple[int | None, torch.Tensor], ...]  # (sliding window, [B, L, n*block_size] True = attend)
    # One sequence whose blocks are one ascending run of the pool (the usual case at batch 1): its context is
    # flat slots [span[0], span[0] + span[1]), which attention reads in place instead of gathering a copy.
    span: tuple[int, int] | None = None
    every_row: bool = False  # q_rows is every row of the step in order (the only group): no gather, no scatter

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        for window, m in self.masks:
            if window == sliding_window:
                return m
        return _mask(self.q_pos, self.blocks.shape[1] * self.block_size, sliding_window)


def _mask(q_pos: torch.Tensor, n_keys: int, sliding_window: int | None) -> torch.Tensor:
    key_pos = torch.arange(n_keys, device=q_pos.device)
    mask = key_pos[None, None] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= key_pos[None, None] > q_pos[:, :, None] - sliding_window
    return mask


@dataclass(frozen=True)
class AttentionPlan:
    """The reference's per-step work split (one batched gather for decode rows, one per prefill chunk) and
    the masks of the sliding windows it was built for; immutable, shared by every layer of the step."""

    block_size: int
    groups: tuple[_Group, ...]


def plan_attention(meta: AttentionMetadata, bs: int, windows: tuple[int | None, ...] = (None,)) -> AttentionPlan:
    qs, lens = meta.query_start_cpu, meta.seq_lens_cpu
    device = meta.block_tables.device
    # seq_len 0 marks a padding sequence (CUDA-graph batches): no keys, zeros out.
    decode = [i for i in range(meta.num_seqs) if qs[i + 1] - qs[i] == 1 and lens[i] > 0]
    groups = [decode] if decode else []
    groups += [[i] for i in range(meta.num_seqs) if qs[i + 1] - qs[i] > 1 and lens[i] > 0]
    plans = []
    for rows in groups:
        qlen = qs[rows[0] + 1] - qs[rows[0]]
        n_blocks = (max(lens[i] for i in rows) + bs - 1) // bs
        idx = torch.tensor(rows, device=device)
        blocks = meta.block_tables.index_select(0, idx)[:, :n_blocks].long()
        seq_len = torch.tensor([lens[i] for i in rows], device=device)
        q_pos = seq_len[:, None] - qlen + torch.arange(qlen, device=device)[None]  # [B, L]
        masks = tuple((w, _mask(q_pos, n_blocks * bs, w)) for w in dict.fromkeys(windows))
        span = None
        if len(rows) == 1:
            q_rows = torch.arange(qs[rows[0]], qs[rows[0] + 1], device=device)
            span = _span(blocks[0], lens[rows[0]], bs)
        else:
            q_rows = torch.tensor([r for i in rows for r in range(qs[i], qs[i + 1])], device=device)
        every = len(groups) == 1 and len(rows) * qlen == qs[-1]
        plans.append(_Group(q_rows, blocks, q_pos, len(rows), qlen, bs, masks, span, every))
    return AttentionPlan(bs, tuple(plans))


def _span(blocks: torch.Tensor, seq_len: int, bs: int) -> tuple[int, int] | None:
    """(first flat slot, seq_len) when `blocks` (one sequence's, on the host) are consecutive pool blocks."""
    if blocks.is_cuda:
        return None  # the reference on a GPU (tests): one host read per step is not worth a copy saved
    ids = blocks.tolist()
    return (ids[0] * bs, seq_len) if ids == list(range(ids[0], ids[0] + len(ids))) else None


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, bs, H, D], blocks [B, n] -> [B, n * bs, H, D]."""
    b, n = blocks.shape
    return cache.index_select(0, blocks.reshape(-1)).view(b, n * cache.shape[1], *cache.shape[2:])


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, Dv], reading all K/V (this step's included) from the pool.
    softcap: tanh soft-capping of the scores (None or 0: off)."""
    bs = k_cache.shape[1]
    plan = meta.ref_plan
    if plan is None or plan.block_size != bs:
        plan = plan_attention(meta, bs, (sliding_window,))
    alloc = torch.zeros if 0 in meta.seq_lens_cpu else torch.empty
    out = None if plan.groups and plan.groups[0].every_row else \
        alloc(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
    for g in plan.groups:
        q_rows = (q if g.every_row else q.index_select(0, g.q_rows)).view(g.batch, g.qlen, *q.shape[1:])
        if g.span is not None:  # in place: SmolLM2 at batch 1 on 2 CPU cores, the gathers were ~4 ms of 28
            start, n = g.span
            k = k_cache.view(-1, *k_cache.shape[2:]).narrow(0, start, n)[None]
            v = v_cache.view(-1, *v_cache.shape[2:]).narrow(0, start, n)[None]
            # A decode row sees every key up to its own: no mask (SDPA's mask-free path is the faster one).
            full = g.qlen == 1 and sliding_window is None and not softcap
            mask = None if full else g.mask(sliding_window)[..., :n]
        else:
            # Decode rows share one batched gather; each prefill runs alone (its query length differs).
            # index_select, not k_cache[g.blocks]: 3x faster on the CPU (7.8 vs 22.6 us, 10 blocks of 16 x 3 x 64)
            k, v = _gather_blocks(k_cache, g.blocks), _gather_blocks(v_cache, g.blocks)
            mask = g.mask(sliding_window)
        res = _attend(q_rows, k, v, mask, scale, softcap or None)
        if g.every_row:
            return res.reshape(-1, *res.shape[2:])
        out.index_copy_(0, g.q_rows, res.reshape(-1, *res.shape[2:]))
    return out


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    if use_triton(q):
        from lamina.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window, softcap=softcap)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, softcap)
