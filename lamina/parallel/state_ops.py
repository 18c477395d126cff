"""Recurrent state under tensor parallelism: the state part of each step message, and the state-pool copies
rank 0 makes outside a forward, replayed on every rank.

Every rank's state pool holds its own heads' state (Gated DeltaNet, Mamba-2), in the same slots: slot
numbers, like block ids, are rank 0's and apply to every rank. Forwards keep the ranks' states in step by
themselves (every rank runs the same step); what rank 0 alone does is copy rows outside a forward:

- a prefix-cache snapshot saved after a step (slot -> snapshot row) and restored at admission (snapshot
  row -> slot), cache/state_snapshots.py;
- speculative rollback committing a verify candidate (candidate slot -> the sequence's slot),
  engine/readback.py.

StatePool tells its `copy_listener` about each one (after doing it on rank 0); the log here keeps them in
order and the next step message carries them, and a worker replays them before that step's forward. On rank
0 they happened between the previous forward and this one, so every rank sees the same sequence of forwards
and copies. The snapshot bookkeeping (which row holds which prefix, eviction) stays on rank 0: a worker only
copies rows.

State message (after the step's header and payload, only when the model has a state pool): int64[HEADER]
n_ops, has_state, candidate slots in all (-1: no candidate lists), candidate table (0/1); then one int64
payload: ops [n_ops, 3] (kind, src, dst) | slots [B] | has-initial-state [B] | candidate counts [B] |
candidates (flat).
"""
from __future__ import annotations

import dataclasses

import torch

from lamina.kernels.metadata import StateMetadata, StepContext
from lamina.parallel.context import ParallelContext

HEADER = 4
KINDS = {"slot": 0, "save": 1, "restore": 2}


class StateOpLog:
    """Rank 0's state-pool copies since the last step message, in the order they were made."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, int, int]] = []

    def record(self, kind: str, src: int, dst: int) -> None:
        self.ops.append((KINDS[kind], src, dst))

    def take(self) -> list[tuple[int, int, int]]:
        ops, self.ops = self.ops, []
        return ops


def attach(pool, log: StateOpLog) -> None:
    """Rank 0: `pool` (a StatePool) reports its copies to `log`."""
    pool.copy_listener = log.record


def send_state(ctx: ParallelContext, batch, log: StateOpLog) -> None:
    """Rank 0: the step's state metadata and the copies to replay first (after send_step)."""
    ops = log.take()
    st = batch.ctx.state
    dev = batch.input_ids.device
    parts = [torch.tensor(ops, dtype=torch.int64).reshape(-1)]
    n_cands, table = -1, 0
    if st is not None:
        parts += [torch.tensor(st.slots_cpu, dtype=torch.int64),
                  torch.tensor(st.has_initial_state_cpu, dtype=torch.int64)]
        if st.candidate_slots_cpu is not None:
            lists = st.candidate_slots_cpu
            n_cands, table = sum(len(c) for c in lists), int(st.candidate_slots is not None)
            parts += [torch.tensor([len(c) for c in lists], dtype=torch.int64),
                      torch.tensor([s for c in lists for s in c], dtype=torch.int64)]
    header = torch.tensor([len(ops), int(st is not None), n_cands, table], dtype=torch.int64)
    payload = torch.cat(parts)
    ctx.broadcast(header.to(dev))
    if payload.numel():
        ctx.broadcast(payload.to(dev))


def recv_state(ctx: ParallelContext, device: torch.device, batch, pool, snapshots):
    """A worker: replays rank 0's copies into its `pool` / `snapshots` (StateSnapshots or None), and returns
    `batch` with the step's state metadata in its context."""
    n_ops, has_state, n_cands, table = ctx.broadcast(torch.empty(HEADER, dtype=torch.int64, device=device)).tolist()
    b = len(batch.ctx.attn.seq_lens_cpu)
    size = 3 * n_ops + (2 * b if has_state else 0) + (b + n_cands if n_cands >= 0 else 0)
    payload = ctx.broadcast(torch.empty(size, dtype=torch.int64, device=device)) if size else None
    host = payload.tolist() if payload is not None else []
    for i in range(n_ops):
        apply_op(pool, snapshots, *host[3 * i:3 * i + 3])
    if not has_state:
        return batch
    k = 3 * n_ops
    slots_cpu, init_cpu = host[k:k + b], [bool(x) for x in host[k + b:k + 2 * b]]
    k += 2 * b
    cands = d_cands = None
    if n_cands >= 0:
        counts, flat, cands = host[k:k + b], host[k + b:], []
        for n in counts:
            cands.append(flat[:n])
            flat = flat[n:]
        if table:
            width = max(1, batch.ctx.attn.max_query_len - 1)
            t = torch.zeros(b, width, dtype=torch.int64)
            for i, c in enumerate(cands):
                t[i, :len(c)] = torch.tensor(c, dtype=torch.int64)
            d_cands = t.to(device)
    slots = payload[3 * n_ops:3 * n_ops + b]
    init = payload[3 * n_ops + b:3 * n_ops + 2 * b].bool()
    state = StateMetadata(slots, init, slots_cpu, init_cpu, cands, d_cands)
    return dataclasses.replace(batch, ctx=StepContext(batch.ctx.attn, state))


def apply_op(pool, snapshots, kind: int, src: int, dst: int) -> None:
    """One of rank 0's copies, on this rank's rows (no bookkeeping: a worker only mirrors the rows)."""
    if kind == KINDS["slot"]:
        for v in pool.views:
            v.copy_row(dst, v, src)
        return
    if snapshots is None:
        raise RuntimeError("rank 0 sent a state snapshot copy, but this rank has no snapshots")
    if kind == KINDS["save"]:
        for live, saved in zip(pool.views, snapshots.views):
            saved.copy_row(dst, live, src)
    elif kind == KINDS["restore"]:
        for live, saved in zip(pool.views, snapshots.views):
            live.copy_row(dst, saved, src)
    else:
        raise RuntimeError(f"unknown state copy kind {kind}")
