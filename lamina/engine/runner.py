"""Builds one step's flat batch (tokens, positions, KV slots, block tables, rows to compute logits for) and
runs the model over it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.engine.scheduler import ScheduledSeq
from lamina.kernels.attention import AttentionMetadata


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    # Per scheduled sequence: (first logits row, number of rows); its sampled row, if any, is the last one.
    logits_rows: list[tuple[int, int]]
    sample_rows: list[int]  # logits rows to sample from, in scheduled order of sampled sequences


class ModelRunner:
    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device) -> None:
        self.model, self.block_size, self.device = model, block_size, device
        self.graphs = None  # a CudaGraphRunner once decode graphs are captured

    def _to_device(self, data: list[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def prepare(self, scheduled: list[ScheduledSeq], pending_rows: dict[int, int] | None = None,
                pending_tokens: torch.Tensor | None = None) -> ForwardBatch:
        """pending_rows maps a sequence whose last token is still on the device (sampled by the step in
        flight) to its row in pending_tokens; that token is copied into the batch on the device."""
        ids: list[int] = []
        dst: list[int] = []
        src: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, seq_lens = [0], []
        logits_idx: list[int] = []
        logits_rows: list[tuple[int, int]] = []
        sample_rows: list[int] = []
        bs = self.block_size
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            row0 = len(ids)
            ids += seq.token_ids[start:end]
            if pending_rows and seq.seq_id in pending_rows and end == seq.num_tokens:
                dst.append(len(ids) - 1)
                src.append(pending_rows[seq.seq_id])
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(len(ids))
            seq_lens.append(end)
            # Rows whose logits are needed: the whole chunk for prompt logprobs, else just the last.
            first = row0 if seq.needs_prompt_logprobs() else (end - 1 - start + row0 if item.sample else None)
            if first is None:
                logits_rows.append((len(logits_idx), 0))
            else:
                logits_rows.append((len(logits_idx), len(ids) - first))
                logits_idx += range(first, len(ids))
                if item.sample:
                    sample_rows.append(len(logits_idx) - 1)
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in scheduled]
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots, torch.long),
            query_start=self._to_device(query_start, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_tables=self._to_device([x for row in tables for x in row], torch.int32).view(len(tables), max_blocks),
            query_start_cpu=query_start,
            seq_lens_cpu=seq_lens,
            max_query_len=max(s.num_tokens for s in scheduled),
            max_seq_len=max(seq_lens),
        )
        if scheduled[0].seq.state_slot is not None:  # hybrid model: every admitted sequence holds a slot
            meta.state_slots_cpu = [s.seq.state_slot for s in scheduled]
            meta.state_slots = self._to_device(meta.state_slots_cpu, torch.long)
            meta.has_initial_state = self._to_device([s.seq.num_computed_tokens > 0 for s in scheduled], torch.bool)
        input_ids = self._to_device(ids, torch.long)
        if dst:
            input_ids.index_copy_(0, self._to_device(dst, torch.long),
                                  pending_tokens.index_select(0, self._to_device(src, torch.long)))
        return ForwardBatch(input_ids, self._to_device(positions, torch.long), meta,
                            self._to_device(logits_idx, torch.long), logits_rows, sample_rows)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] in fp32."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model(batch.input_ids, batch.positions, batch.attn, batch.logits_indices)
