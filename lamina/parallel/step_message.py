"""The per-step message from the rank-0 runner to the tensor-parallel workers.

Rank 0 builds the step (scheduling, block tables, the tokens of the step in flight copied in on the device)
and then sends exactly what the model's forward reads: token ids, positions, KV slots, logits rows, query
starts, sequence lengths and block tables, as one int64 payload, preceded by a fixed header of sizes (so each
worker can size its receive buffer). Two broadcasts per step, whatever the batch; nothing about requests,
sampling or the scheduler travels. Every rank then runs the same forward; rank 0 alone samples.

Header (int64[HEADER]): kind, tokens T, logits rows L, sequences B, block-table width W, max query len,
max sequence len, graph slot (the CUDA graph rank 0 replays, which every worker replays: tp_graphs.py).
Payload: ids[T] | positions[T] | slots[T] | logits rows[L] | query starts[B+1] | sequence lengths[B] |
block tables[B*W].
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from lamina.kernels.attention import AttentionMetadata, plan_attention
from lamina.kernels.metadata import StepContext
from lamina.parallel.context import ParallelContext

HEADER = 8
STEP, STOP = 1, 2


def send_step(ctx: ParallelContext, batch) -> None:
    """Broadcasts `batch`'s (a runner ForwardBatch) model inputs from rank 0."""
    a = batch.ctx.attn  # recurrent-state metadata follows in a message of its own (parallel/state_ops.py)
    b, w = a.block_tables.shape
    dev = batch.input_ids.device
    header = torch.tensor([STEP, batch.input_ids.shape[0], batch.logits_indices.shape[0], b, w,
                           a.max_query_len, a.max_seq_len, batch.graph_slot or 0], dtype=torch.int64)
    if dev.type == "cuda":  # NCCL sends device tensors; a pinned source keeps the copy from syncing the host
        header = header.pin_memory().to(dev, non_blocking=True)
    payload = torch.cat([batch.input_ids.long(), batch.positions.long(), a.slot_mapping.long(),
                         batch.logits_indices.long(), a.query_start.long(), a.seq_lens.long(),
                         a.block_tables.long().reshape(-1)])
    ctx.broadcast(header)
    ctx.broadcast(payload)


def send_stop(ctx: ParallelContext, device: torch.device) -> None:
    header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    header[0] = STOP
    ctx.broadcast(header)


def recv_step(ctx: ParallelContext, device: torch.device, block_size: int,
              ref_windows: tuple[int | None, ...] | None):
    """On a worker: the next step's ForwardBatch (for ModelRunner.execute), or None when told to stop.
    ref_windows: the sliding windows to plan the torch reference attention for (None: Triton kernels)."""
    from lamina.engine.runner import ForwardBatch

    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    kind, t, n_logits, b, w, max_q, max_seq, graph = ctx.broadcast(header).tolist()
    if kind == STOP:
        return None
    if kind != STEP:
        raise RuntimeError(f"unknown tensor-parallel message kind {kind}")
    payload = torch.empty(3 * t + n_logits + 2 * b + 1 + b * w, dtype=torch.int64, device=device)
    ctx.broadcast(payload)
    ids, pos, slots, logits, qs, lens, tables = payload.split([t, t, t, n_logits, b + 1, b, b * w])
    qs32, lens32 = qs.int(), lens.int()
    host = torch.cat([qs, lens]).tolist()  # the host lists the attention plan and references read
    attn = AttentionMetadata(slots, qs32, lens32, tables.int().view(b, w), host[:b + 1], host[b + 1:], max_q,
                             max_seq)
    if ref_windows is not None:
        attn = dataclasses.replace(attn, ref_plan=plan_attention(attn, block_size, ref_windows))
    empty = np.zeros(0, np.int64)
    return ForwardBatch(ids, pos, StepContext(attn), logits, empty, empty, None, [], [], graph_slot=graph)
