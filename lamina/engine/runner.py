"""Builds one step's flat batch (tokens, positions, KV slots, block tables, rows to compute logits for and to
sample) and runs the model over it.

One pass over the scheduled sequences reads their scalars and token slices; everything per token (positions,
slot mapping, logits rows) is numpy arithmetic over those per-sequence arrays. The forward's arrays reach the
device in one copy (StepStaging); block tables are persistent rows (BlockTables) of which only the changed
entries travel. The sampling parameters go in a second copy of their own (ship_sampling), made after the
forward is launched: the sampler runs after the forward, so their host work (build_arrays, ~25 arrays) overlaps
the device instead of delaying the launch (a verify step, read back before the next one is built, has that
host time on its critical path).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from lamina.engine.block_tables import BlockTables
from lamina.engine.request import Sequence
from lamina.engine.sampling_metadata import SamplingMetadata, array_list, metadata_from
from lamina.engine.scheduler import ScheduledSeq
from lamina.engine.staging import StepStaging
from lamina.kernels.attention import AttentionMetadata, plan_attention
from lamina.kernels.dispatch import triton_available
from lamina.kernels.metadata import StateMetadata, StepContext
from lamina.parallel.tp_graphs import graph_for, graph_slot

# Stands in token_ids for a sampled token not yet read back; never fed to the model (the runner copies the
# real token on the device) and never hashed (the prefix cache only registers known tokens).
PENDING = -1


@dataclass
class PendingTokens:
    """Tokens of the step in flight, still on the device: sequence id -> (index in token_ids of its first
    sampled token, its first row in `tokens`); its sampled tokens are consecutive in both."""

    first: dict[int, tuple[int, int]]
    tokens: torch.Tensor


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: StepContext
    logits_indices: torch.Tensor
    # Per scheduled sequence: its first logits row and number of logits rows (the whole chunk for prompt
    # logprobs, else its sampled rows; the sampled rows are always its last ones).
    logits_start: np.ndarray
    num_logits: np.ndarray
    sample_rows: torch.Tensor | None  # logits rows sampled, in scheduled order; None: every logits row
    sampled: list[Sequence]  # the sequence of each sampled row
    offsets: list[int]  # each sampled row's place among its sequence's sampled rows
    sampling: SamplingMetadata | None = None  # shipped with the batch when the runner was given a sampler
    # Tensor parallelism: the CUDA graph rank 0 chose for this step (parallel/tp_graphs.py: 0 eager, i + 1 the
    # runner's i-th graph key), which every rank replays; None: the runner picks.
    graph_slot: int | None = None

    @property
    def attn(self) -> AttentionMetadata:
        return self.ctx.attn

    def sampled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.sample_rows is None else logits.index_select(0, self.sample_rows)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on the device without a host sync: a copy from pageable memory waits for the stream
    to drain (the step in flight), one from pinned memory (PyTorch's caching host allocator, which keeps the
    buffer until its copy ran) does not."""
    t = torch.from_numpy(array)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + c) for s, c in zip(starts, counts)) without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(total)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device) -> None:
        self.model, self.block_size, self.device = model, block_size, device
        self.graphs = None  # a CudaGraphRunner once decode graphs are captured
        # A proposer that drafts from the target's hidden states (mtp) sets keep_hidden: execute() then leaves
        # the step's backbone output [tokens, H] in last_hidden (valid until the next execute).
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.staging = StepStaging(device)
        # Its own buffers: one turn per step each, so neither copy waits on the other's still-queued one.
        self.sampling_staging = StepStaging(device)
        self.tables = BlockTables(device)
        # The window group's rows (cache/kv_groups.py), made on the first step whose sequences have a window table.
        self.window_tables: BlockTables | None = None
        # The torch reference attention gets its per-step plan built once here, for the model's windows.
        self._ref_windows = None
        if not (device.type == "cuda" and triton_available()):
            specs = getattr(getattr(model, "config", None), "layers", None) or []
            self._ref_windows = tuple(dict.fromkeys(s.sliding_window for s in specs
                                                    if s.mixer in ("attention", "gated_attention"))) or (None,)
        lm_head = getattr(model, "lm_head", None)
        self.vocab = lm_head.weight.shape[0] if lm_head is not None else None
        if getattr(getattr(lm_head, "format", None), "gather", False):  # vocab-parallel: logits come gathered
            self.vocab = lm_head.out_features
        # Tensor parallelism: called with each batch before its forward (rank 0 broadcasts the step's inputs
        # to the workers, lamina/parallel/); None: a single process.
        self.step_sink = None

    @torch.inference_mode()  # its persistent buffers are updated in place, whoever first created them
    def prepare(self, scheduled: list[ScheduledSeq], pending: PendingTokens | None = None) -> ForwardBatch:
        """The step's batch. pending: tokens of the step in flight (PENDING in token_ids), copied into the
        batch on the device. Its sampling parameters: ship_sampling, once the forward is launched."""
        b = len(scheduled)
        whole = np.zeros(b, bool)  # prompt logprobs: logits for the whole chunk
        ids: list[int] = []
        seqs, start_l, ntok_l, nsamp_l = [], [], [], []  # Python lists, one numpy conversion each
        for i, item in enumerate(scheduled):
            seq = item.seq
            s, n = seq.num_computed_tokens, item.num_tokens
            start_l.append(s)
            ntok_l.append(n)
            nsamp_l.append(item.num_sampled)
            seqs.append(seq)
            if n == 1:
                ids.append(seq.token_ids[s])
            else:
                known = len(seq.token_ids)
                ids += seq.token_ids[s:s + n]
                if s + n > known:  # draft tokens being verified
                    ids += seq.draft_token_ids[:s + n - known]
            if seq.wants_prompt_logprobs and seq.needs_prompt_logprobs():
                whole[i] = True
        start = np.array(start_l, np.int64)
        ntok = np.array(ntok_l, np.int64)
        nsamp = np.array(nsamp_l, np.int64)
        qe = np.cumsum(ntok)
        qs = np.concatenate([[0], qe])
        t = int(qe[-1])
        tok_seq = np.repeat(np.arange(b), ntok)
        positions = np.repeat(start - qs[:-1], ntok) + np.arange(t)
        seq_lens = start + ntok
        rows, upd_flat, upd_vals = self.tables.update(seqs)
        bs = self.block_size
        slots = self.tables.host[rows[tok_seq], positions // bs].astype(np.int64) * bs + positions % bs
        nlog = np.where(whole, ntok, nsamp)
        logits_idx = _ragged_arange(qe - nlog, nlog)
        lstart = np.cumsum(nlog) - nlog
        input_ids = np.asarray(ids, np.int64)
        dst = np.flatnonzero(input_ids == PENDING)
        src = self._pending_sources(dst, tok_seq, positions, seqs, pending)
        sample_rows = None if not whole.any() else _ragged_arange(lstart + nlog - nsamp, nsamp)
        sampled = [seq for seq, k in zip(seqs, nsamp_l) for _ in range(k)]
        offsets = [j for k in nsamp_l for j in range(k)]

        st = self.staging
        parts = [input_ids, positions, slots, logits_idx, qs.astype(np.int32), seq_lens.astype(np.int32), rows,
                 upd_flat, upd_vals, dst, src]
        # A window group: every scheduled sequence has a window table (a proposer's sequences have none).
        windowed = bool(getattr(seqs[0], "window_table", None))
        if windowed:
            if self.window_tables is None:
                self.window_tables = BlockTables(self.device, "window_table")
            w_rows, w_flat, w_vals = self.window_tables.update(seqs)
            w_slots = (self.window_tables.host[w_rows[tok_seq], positions // bs].astype(np.int64) * bs
                       + positions % bs)
            parts += [w_slots, w_rows, w_flat, w_vals]
        hybrid = seqs[0].state_slot is not None  # hybrid model: every admitted sequence holds a slot
        if hybrid:
            state_slots = np.fromiter((s.state_slot for s in seqs), np.int64, b)
            parts += [state_slots, start > 0]
        if sample_rows is not None:
            parts.append(sample_rows)
        for p in parts:
            st.add(p)
        dev = st.ship()
        d_ids, d_pos, d_slots, d_logits, d_qs, d_lens, d_rows, d_flat, d_vals, d_dst, d_src = dev[:11]
        if dst.size:
            d_ids.index_copy_(0, d_dst, pending.tokens.index_select(0, d_src))
        self.tables.apply(d_flat, d_vals)
        width = max(len(s.block_table) for s in seqs)
        attn = AttentionMetadata(d_slots, d_qs, d_lens, self.tables.gather(d_rows, width), qs.tolist(),
                                 seq_lens.tolist(), int(ntok.max()), int(seq_lens.max()))
        k = 11
        if windowed:
            d_wslots, d_wrows, d_wflat, d_wvals = dev[k:k + 4]
            k += 4
            self.window_tables.apply(d_wflat, d_wvals)
            win = dataclasses.replace(attn, slot_mapping=d_wslots, block_tables=self.window_tables.gather(
                d_wrows, max(len(s.window_table) for s in seqs)))
            if self._ref_windows is not None:
                win = dataclasses.replace(win, ref_plan=plan_attention(win, bs, self._ref_windows))
            attn = dataclasses.replace(attn, window=win)
        if self._ref_windows is not None:
            attn = dataclasses.replace(attn, ref_plan=plan_attention(attn, bs, self._ref_windows))
        state = None
        if hybrid:
            cands = [s.candidate_slots for s in seqs]
            d_cands = None
            if any(cands) and all(len(c) == n - 1 for c, n in zip(cands, ntok.tolist())):
                width = max(1, int(ntok.max()) - 1)
                table = np.zeros((b, width), np.int64)
                for i, c in enumerate(cands):
                    table[i, :len(c)] = c
                d_cands = to_device(table, self.device)
            state = StateMetadata(dev[k], dev[k + 1], state_slots.tolist(), (start > 0).tolist(),
                                  cands if any(cands) else None, d_cands)
            k += 2
        d_sample_rows = None
        if sample_rows is not None:
            d_sample_rows = dev[k]
        return ForwardBatch(d_ids, d_pos, StepContext(attn, state), d_logits, lstart, nlog, d_sample_rows,
                            sampled, offsets)

    @torch.inference_mode()
    def ship_sampling(self, batch: ForwardBatch, sampler, pending: PendingTokens | None = None) -> None:
        """Sets batch.sampling: the sampler's per-row arrays for the batch's sampled rows, in one copy (after
        execute(batch) is launched, so this host work overlaps the forward). pending: as given to prepare."""
        if not batch.sampled or self.vocab is None:
            return
        arrays = sampler.arrays(batch.sampled, batch.offsets, self.vocab,
                                pending.first if pending is not None else None)
        st = self.sampling_staging
        for p in array_list(arrays):
            st.add(p)
        batch.sampling = metadata_from(arrays, st.ship(), batch.sampled)
        if arrays.late_row.size:
            batch.sampling.late_tokens = pending.tokens

    @staticmethod
    def _pending_sources(dst: np.ndarray, tok_seq: np.ndarray, positions: np.ndarray, seqs: list[Sequence],
                         pending: PendingTokens | None) -> np.ndarray:
        """For each PENDING input row, its row in pending.tokens (token index - first index + first row)."""
        if not dst.size:
            return np.zeros(0, np.int64)
        if pending is None:
            raise RuntimeError("a scheduled token is still in flight, but no pending tokens were given")
        owner = tok_seq[dst]
        base = np.empty(len(seqs), np.int64)
        for i in np.unique(owner).tolist():
            first = pending.first.get(seqs[i].seq_id)
            if first is None:
                raise RuntimeError(f"sequence {seqs[i].seq_id} has a token in flight that no launched step samples")
            base[i] = first[1] - first[0]
        return base[owner] + positions[dst]

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] in fp32."""
        if self.step_sink is not None:
            return self._execute_parallel(batch)
        logits = None
        if batch.graph_slot is not None:  # tensor parallelism: rank 0's choice, replayed by every rank
            key = graph_for(self.graphs, batch.graph_slot)
            if key is not None:
                logits = self.graphs.run(batch, key)
        elif self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.run(batch)
        if logits is not None:
            if self.keep_hidden:  # the graph's static buffer: its first rows are this batch's tokens
                self.last_hidden = self.graphs.hidden[:batch.input_ids.shape[0]]
            return logits
        if self.keep_hidden:
            self.last_hidden = self.model.hidden_states(batch.input_ids, batch.positions, batch.ctx)
            return self.model.compute_logits(self.last_hidden.index_select(0, batch.logits_indices))
        return self.model(batch.input_ids, batch.positions, batch.ctx, batch.logits_indices)

    def _execute_parallel(self, batch: ForwardBatch) -> torch.Tensor:
        """Sends the step to the tensor-parallel workers, then runs this rank's forward. A forward that fails
        here after the workers started theirs leaves them waiting in a collective: fatal for the group."""
        from lamina.parallel.context import ParallelFailure

        batch = dataclasses.replace(batch, graph_slot=graph_slot(self.graphs, batch))  # the workers replay it too
        sink, self.step_sink = self.step_sink, None
        try:
            sink(batch)
            return self.execute(batch)
        except ParallelFailure:
            raise
        except Exception as e:
            raise ParallelFailure(f"the forward failed on rank 0 after the workers started it ({type(e).__name__}: "
                                  f"{e}); the tensor-parallel ranks are out of step") from e
        finally:
            self.step_sink = sink
