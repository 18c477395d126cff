"""The static inputs CUDA graphs read, and how one step's batch is padded into them (runs on any device, so
the padding is tested on the CPU).

Every graph reads prefixes of the same buffers (stable addresses); a step copies its batch into them and
writes the padding:
- token rows [T, T_pad): slot -1 (no KV write), stale ids and positions (any valid value will do);
- decode graphs: the padded sequences [B, B_pad) keep query length 1 (static query_start 0..B_pad) and get
  seq_len 0 (no key read; zeros out);
- mixed graphs: sequence slot B owns the padding rows (query_start[B + 1:] = T_pad) with seq_len 0, and the
  slots after it are empty (query length 0). `num_seqs` on the device holds B + 1, so the prefill kernel's
  programs numbered past the used sequences exit at once.
Padded rows thus come out of attention as zeros and stay finite through every row-wise layer; nothing reads
them afterwards (the runner samples real rows only).
- hybrid models (a state pool): every padded sequence slot (the padding rows' sequence and the empty slots of a
  mixed graph, the padded sequences of a decode graph) points at the pool's padding slot, which no sequence
  ever leases, with has_initial_state False: its state is never read (a padded row computes from zeros, so
  whatever earlier padding left there cannot grow into inf/NaN across replays) and only that slot is written.
  Empty slots (query length 0) write nothing at all.
- a window group (cache/kv_groups.py): its slot mapping and block tables are padded like the primary ones
  (slot -1 past the batch; stale table entries are never read, the padded sequences having seq_len 0).
- hybrid verify graphs (graph_keys.verify_keys: b * L rows, 2b slots): the real sequences, then padding
  sequences of L rows each (the last shorter; query_start[B + 1 + j] = min(T + (j + 1) L, T_pad)) with seq_len
  0 on the padding slot, then empty slots. Every candidate-table entry but the real sequences' own points at
  the padding slot, so the verify kernels' per-position state writes of padding rows land there too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lamina.engine.graph_keys import GraphKey, verify_padding_seqs
from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.attention_launch import AttentionLaunch
from lamina.kernels.metadata import StateMetadata, StepContext


@dataclass(frozen=True)
class GraphMetadata(AttentionMetadata):
    """AttentionMetadata whose kernel choice is fixed by the graph key (see attention_launch.py)."""

    launch: AttentionLaunch | None = None


class GraphInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device,
                 padding_slot: int | None = None, windowed: bool = False, verify_width: int = 0) -> None:
        """verify_width: L = K + 1 of the verify graphs (hybrid models with speculative decoding), else 0."""
        kw = {"device": device}
        self.padding_slot = padding_slot
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, **kw)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, **kw)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, **kw)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, **kw)
        self.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, **kw)
        self.decode_query_start = torch.arange(max_seqs + 1, dtype=torch.int32, **kw)  # never written
        self.mixed_query_start = torch.zeros(max_seqs + 1, dtype=torch.int32, **kw)
        self.num_seqs = torch.ones(1, dtype=torch.int32, **kw)
        self.window_slot_mapping = self.window_block_tables = None
        if windowed:
            self.window_slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, **kw)
            self.window_block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, **kw)
        self.state_slots = self.has_initial_state = None
        if padding_slot is not None:  # hybrid models: padded rows use the state pool's padding slot
            self.state_slots = torch.full((max_seqs,), padding_slot, dtype=torch.long, **kw)
            self.has_initial_state = torch.zeros(max_seqs, dtype=torch.bool, **kw)
        self.candidates = None
        if padding_slot is not None and verify_width >= 2:  # verify graphs: row b's L - 1 candidate slots
            self.candidates = torch.full((max_seqs, verify_width - 1), padding_slot, dtype=torch.long, **kw)
            self.ramp = torch.arange(1, max_seqs + 1, dtype=torch.int32, **kw)  # never written

    @property
    def max_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def fits(self, batch, key: GraphKey) -> bool:
        meta, state = batch.ctx.attn, batch.ctx.state
        if state is not None and state.candidate_slots_cpu is not None:
            # A verify step keeps the state after every draft position: only a verify graph computes those
            # (another graph would leave the candidate slots unwritten), and only from the device table.
            if not key.verify or state.candidate_slots is None or self.candidates is None or \
                    meta.max_query_len > key.verify or state.candidate_slots.shape[1] > self.candidates.shape[1]:
                return False
        elif key.verify:
            return False
        return (key.tokens <= self.max_tokens and key.seqs <= self.max_seqs
                and meta.block_tables.shape[1] <= self.max_blocks
                and (meta.window is None) == (self.window_slot_mapping is None)
                and (meta.window is None or meta.window.block_tables.shape[1] <= self.max_blocks)
                and (state is None) == (self.state_slots is None))

    def load(self, batch, key: GraphKey) -> None:
        """Copies a step's batch (a runner ForwardBatch) into the buffers and writes key's padding.

        Device-to-device copies and fills only: no host sync, and the batch may still be in flight."""
        meta, state = batch.ctx.attn, batch.ctx.state
        t, b, tp, bp = batch.input_ids.shape[0], meta.num_seqs, key.tokens, key.seqs
        assert t <= tp and b <= bp - (not key.decode), (t, b, key)
        nb = {"non_blocking": True}
        self.input_ids[:t].copy_(batch.input_ids, **nb)
        self.positions[:t].copy_(batch.positions, **nb)
        self.slot_mapping[:t].copy_(meta.slot_mapping, **nb)
        self.slot_mapping[t:tp].fill_(-1)
        self.seq_lens[:b].copy_(meta.seq_lens, **nb)
        self.seq_lens[b:bp].fill_(0)
        # Columns past the batch's width keep stale ids: kernels read block-table entries below seq_len only.
        self.block_tables[:b, : meta.block_tables.shape[1]].copy_(meta.block_tables, **nb)
        if self.window_slot_mapping is not None:
            win = meta.window
            self.window_slot_mapping[:t].copy_(win.slot_mapping, **nb)
            self.window_slot_mapping[t:tp].fill_(-1)
            self.window_block_tables[:b, : win.block_tables.shape[1]].copy_(win.block_tables, **nb)
        if key.verify:
            self.mixed_query_start[: b + 1].copy_(meta.query_start, **nb)
            if bp > b:  # padding sequences of key.verify rows, then empty slots (graph_keys.verify_padding_starts)
                self.mixed_query_start[b + 1: bp + 1].copy_((self.ramp[: bp - b] * key.verify + t).clamp_(max=tp))
            self.num_seqs.fill_(b + verify_padding_seqs(t, key))
            width = state.candidate_slots.shape[1]
            self.candidates[:b, :width].copy_(state.candidate_slots, **nb)
            self.candidates[:b, width:].fill_(self.padding_slot)
            self.candidates[b:bp].fill_(self.padding_slot)
        elif not key.decode:
            self.mixed_query_start[: b + 1].copy_(meta.query_start, **nb)
            self.mixed_query_start[b + 1: bp + 1].fill_(tp)
            self.num_seqs.fill_(b + 1)
        if self.state_slots is not None:
            self.state_slots[:b].copy_(state.slots, **nb)
            self.state_slots[b:bp].fill_(self.padding_slot)
            self.has_initial_state[:b].copy_(state.has_initial_state, **nb)
            self.has_initial_state[b:bp].fill_(False)

    def reset(self, key: GraphKey) -> None:
        """A batch of padding only (what warm-up and capture run on): no KV writes, zeros out of attention."""
        tp, bp = key.tokens, key.seqs
        self.slot_mapping[:tp].fill_(-1)
        if self.window_slot_mapping is not None:
            self.window_slot_mapping[:tp].fill_(-1)
        self.seq_lens[:bp].fill_(0)
        if key.verify:  # padding sequences of key.verify rows only
            self.mixed_query_start[0] = 0
            self.mixed_query_start[1: bp + 1].copy_((self.ramp[:bp] * key.verify).clamp_(max=tp))
            self.num_seqs.fill_(verify_padding_seqs(0, key))
            self.candidates[:bp].fill_(self.padding_slot)
        elif not key.decode:
            self.mixed_query_start[0] = 0
            self.mixed_query_start[1: bp + 1].fill_(tp)
            self.num_seqs.fill_(1)
        if self.state_slots is not None:
            self.state_slots[:bp].fill_(self.padding_slot)
            self.has_initial_state[:bp].fill_(False)

    def context(self, key: GraphKey, max_model_len: int, exact_host: bool = False) -> StepContext:
        """The step context (attention + state metadata) a graph of `key` is captured with. Its host fields
        describe the key, not a step:
        kernels take their choice from `launch` and their grids from shapes. exact_host=True reads the
        buffers back instead (a host sync), for running the body through the torch reference on a CPU."""
        tp, bp = key.tokens, key.seqs
        qs = (self.decode_query_start if key.decode else self.mixed_query_start)[: bp + 1]
        if exact_host:
            qs_cpu, lens_cpu = qs.tolist(), self.seq_lens[:bp].tolist()
            max_q = max(qs_cpu[i + 1] - qs_cpu[i] for i in range(bp))
            max_seq = max(lens_cpu)
        else:
            # Mixed graphs: query lengths are data, so the host list stays empty (a reader fails loudly).
            qs_cpu, lens_cpu = (list(range(bp + 1)) if key.decode else []), [max_model_len] * bp
            max_q, max_seq = (1 if key.decode else key.verify or tp), max_model_len
        launch = AttentionLaunch(True, False) if key.decode else AttentionLaunch(True, True, self.num_seqs)
        meta = GraphMetadata(self.slot_mapping[:tp], qs, self.seq_lens[:bp], self.block_tables[:bp], qs_cpu,
                             lens_cpu, max_q, max_seq, launch=launch)
        if self.window_slot_mapping is not None:
            meta = dataclasses.replace(meta, window=dataclasses.replace(
                meta, slot_mapping=self.window_slot_mapping[:tp], block_tables=self.window_block_tables[:bp]))
        state = None
        if self.state_slots is not None:
            slots, init = self.state_slots[:bp], self.has_initial_state[:bp]
            # Not exact: placeholders no GPU kernel reads (they take slots and flags from the device tensors).
            cands = cands_cpu = None
            if key.verify:
                cands = self.candidates[:bp]
                if exact_host:  # row b: its first L_b - 1 entries, as the runner lists them
                    cands_cpu = [row[: max(0, qs_cpu[i + 1] - qs_cpu[i] - 1)] for i, row in enumerate(cands.tolist())]
                else:  # a placeholder that marks the step as a verify step (kernels read `cands`)
                    cands_cpu = [[self.padding_slot] * (key.verify - 1)] * bp
            state = StateMetadata(slots, init, slots.tolist() if exact_host else [self.padding_slot] * bp,
                                  init.tolist() if exact_host else [False] * bp, cands_cpu, cands)
        return StepContext(meta, state)
