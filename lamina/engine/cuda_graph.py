"""CUDA graphs for decode steps: one graph per padded batch size, replayed with new inputs.

A decode step of a small model is hundreds of short kernel launches; replaying a captured graph removes
the launch overhead. The graph reads its inputs from static buffers (stable addresses), so each step only
copies the batch into them. Padded rows write no KV (slot -1) and attend to one token of block 0; in hybrid
models they point at the state pool's padding slot, which no sequence leases, and may scribble there.
"""
from __future__ import annotations

import logging

import torch

from lamina.engine.runner import ForwardBatch
from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.metadata import StateMetadata, StepContext

log = logging.getLogger("lamina")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256 + 1, 16))
    return [s for s in sizes if s <= max(max_num_seqs, 1)] or [1]


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, padding_slot: int | None = None) -> None:
        self.model, self.device = model, device
        self.padding_slot = padding_slot  # set when the model keeps per-sequence state in a StatePool
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        self.max_model_len = max_model_len
        n = self.max_bs
        kw = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, **kw)
        self.positions = torch.zeros(n, dtype=torch.long, **kw)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, **kw)
        self.seq_lens = torch.ones(n, dtype=torch.int32, **kw)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, **kw)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, **kw)
        self.logits_indices = torch.arange(n, dtype=torch.long, **kw)
        self.state_slots = self.has_initial_state = None
        if padding_slot is not None:
            self.state_slots = torch.full((n,), padding_slot, dtype=torch.long, **kw)
            self.has_initial_state = torch.ones(n, dtype=torch.bool, **kw)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _context(self, bs: int) -> StepContext:
        # Host-side fields describe the worst case: kernels size their grids from them, never from data.
        attn = AttentionMetadata(self.slot_mapping[:bs], self.query_start[:bs + 1], self.seq_lens[:bs],
                                 self.block_tables[:bs], list(range(bs + 1)), [self.max_model_len] * bs,
                                 1, self.max_model_len)
        state = None
        if self.state_slots is not None:
            state = StateMetadata(self.state_slots[:bs], self.has_initial_state[:bs], [self.padding_slot] * bs,
                                  [True] * bs)
        return StepContext(attn, state)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self._context(bs), self.logits_indices[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, allocator settles
                    self._forward(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, batch: ForwardBatch) -> bool:
        meta = batch.ctx.attn
        n = meta.num_seqs
        return (meta.is_decode_only and n <= self.max_bs and batch.logits_indices.shape[0] == n
                and meta.block_tables.shape[1] <= self.max_blocks
                and (batch.ctx.state is None) == (self.state_slots is None))

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        meta, state = batch.ctx.attn, batch.ctx.state
        n = meta.num_seqs
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if self.state_slots is not None:
            self.state_slots[:n].copy_(state.slots, non_blocking=True)
            self.state_slots[n:bs].fill_(self.padding_slot)
            self.has_initial_state[:n].copy_(state.has_initial_state, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
