"""mtp: the checkpoint's multi-token-prediction head (spec/mtp_head.py) drafts from the target's hidden states.

The head's KV at position p reads token p+1 and the target's hidden state at p. Its one attention layer is a
layer of the target's KV pool (engine/build.py budgets and binds it with the others), so it shares the
target's block tables: preemption, trimming after rejections, and prefix-cache hits apply to it as to every
target layer (a cached block carries the head's KV of its positions too; the head writes its last position
one step after the target, so a sequence hitting a block in between reads stale values there, which costs
draft quality, never correctness: drafts are only guesses).

Hidden states: the engine hands every step's backbone output to observe(); each sequence keeps the rows of
positions the head has not consumed yet (rows of rejected drafts are dropped once the target rolls back).
propose() first catches the head up to the sequence's last computed position T-2 (T known tokens): the last
row of that pass reads token T-1 and h_{T-2} and its logits give draft 1. Draft j+1 reads draft j and the
head's own output at the previous position (T-2+j), written into the blocks the verify step then uses. Only
the catch-up is kept: the verify step's positions are rewritten with the target's hidden states once those
exist. Drafts are greedy (one-hot q: spec/accept.py is exact).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from lamina.engine.request import SeqStatus, Sequence
from lamina.engine.runner import ModelRunner
from lamina.engine.scheduler import ScheduledSeq
from lamina.spec.mtp_head import MTPHead

if TYPE_CHECKING:
    from lamina.engine.engine import LLMEngine

log = logging.getLogger("lamina")


class MTPSeq:
    """What the head's runner reads of one target sequence (its blocks are the target's), and the target hidden
    rows the head has not consumed yet."""

    def __init__(self, target: Sequence, start: int) -> None:
        self.target, self.seq_id = target, target.seq_id
        self.token_ids: list[int] = []  # index p: the target's token p + 1 (as they become known)
        self.num_computed_tokens = start  # the head's KV is written for positions below (or the cache holds it)
        self.draft_token_ids: list[int] = []
        self.state_slot = None
        self.wants_prompt_logprobs = False
        self.status = SeqStatus.RUNNING
        self._rows: list[torch.Tensor] = []  # pending target hidden states, positions hidden_start onwards
        self._num_rows = 0

    @property
    def block_table(self) -> list[int]:
        return self.target.block_table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def needs_prompt_logprobs(self) -> bool:
        return False

    @property
    def hidden_start(self) -> int:  # invariant: the position right after the last one the head consumed
        return self.num_computed_tokens

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + self._num_rows

    def keep_before(self, pos: int) -> None:
        """Drops the pending rows (and, before hidden_start, the head's KV) of positions >= pos: the target
        recomputes them (a rejected draft, a preempted sequence) or they were never valid."""
        if pos < self.hidden_start:
            self.num_computed_tokens = pos
            self._rows, self._num_rows = [], 0
            return
        keep = pos - self.hidden_start
        if keep >= self._num_rows:
            return
        rows = self.take_rows()[:keep]
        self._rows, self._num_rows = ([rows] if keep else []), keep

    def push(self, rows: torch.Tensor) -> None:
        self._rows.append(rows)
        self._num_rows += rows.shape[0]

    def take_rows(self) -> torch.Tensor:
        """The pending rows as one tensor (they stay pending until the head's computed length moves on)."""
        if len(self._rows) > 1:
            self._rows = [torch.cat(self._rows)]
        return self._rows[0]

    def consumed(self, n: int) -> None:
        """The head computed its next n indices from the first n pending rows."""
        rows = self.take_rows()[n:]
        self.num_computed_tokens += n
        self._rows, self._num_rows = ([rows] if rows.shape[0] else []), rows.shape[0]


class MTPProposer:
    needs_hidden_states = True  # the engine's runner keeps each step's backbone output for observe()

    def __init__(self, target: torch.nn.Module, head: MTPHead, scheduler, block_size: int, device: torch.device,
                 max_tokens_per_pass: int) -> None:
        self.target, self.head, self.scheduler = target, head, scheduler
        self.runner = ModelRunner(head, block_size, device)
        self.max_tokens_per_pass = max_tokens_per_pass
        self.seqs: dict[int, MTPSeq] = {}
        self.keep_logits = False  # tests: last_logits[seq_id] = the draft logits [drafts, vocab] of the last proposal
        self.last_logits: dict[int, torch.Tensor] = {}

    @classmethod
    def build(cls, engine: LLMEngine) -> MTPProposer:
        head = getattr(engine, "spec_weights", None)  # loaded, budgeted and bound with the pool (spec/build.py)
        if not isinstance(head, MTPHead):
            raise ValueError("speculative_config: method 'mtp': the MTP head was not loaded with the KV pool")
        params = sum(p.numel() for p in head.parameters())
        log.info("mtp: the checkpoint's MTP head (one %s layer, %.1fM parameters) drafts %d token(s); its KV is "
                 "one more layer of the pool", "MoE" if head.config.layers[0].ffn == "moe" else "dense",
                 params / 1e6, engine.config.speculative_config.num_speculative_tokens)
        return cls(engine.model, head, engine.scheduler, engine.config.block_size, engine.device,
                   engine.config.max_num_batched_tokens)

    # ---- bookkeeping -----------------------------------------------------------------------------------
    def _release(self, rec: MTPSeq) -> None:
        rec.status = SeqStatus.FINISHED  # its row in the head's block-table mirror may be reclaimed
        del self.seqs[rec.seq_id]

    def release_stale(self) -> None:
        """Drops the head's records of sequences that finished or were preempted (their pending rows)."""
        for rec in [r for r in self.seqs.values() if r.target.status != SeqStatus.RUNNING]:
            self._release(rec)

    @torch.inference_mode()
    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """A target step's backbone output [tokens, H] (rows in scheduled order), before the step commits:
        each sequence's rows are its positions num_computed_tokens onwards."""
        row = 0
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            rows, row = hidden[row:row + n], row + n
            if seq.finished or seq.status != SeqStatus.RUNNING:
                continue
            s = seq.num_computed_tokens
            rec = self.seqs.get(seq.seq_id)
            if rec is not None and (rec.target is not seq or s > rec.hidden_end):
                self._release(rec)  # out of step with the target (positions it computed unobserved)
                rec = None
            if rec is None:
                rec = self.seqs[seq.seq_id] = MTPSeq(seq, s)
            rec.keep_before(s)
            rec.push(rows.clone())  # a captured graph's output buffer is overwritten by the next replay

    # ---- drafting --------------------------------------------------------------------------------------
    def _pass(self, items: list[ScheduledSeq], hidden: torch.Tensor) -> torch.Tensor:
        """The head over items (one chunk per sequence); its output at each item's last row [items, H]."""
        batch = self.runner.prepare(items)
        embeds = self.target.model.embed_tokens(batch.input_ids)
        out = self.head(embeds, hidden, batch.positions, batch.ctx)
        return out.index_select(0, batch.logits_indices)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        self.release_stale()
        drafts: list[list[int]] = [[] for _ in seqs]
        self.last_logits = {}
        work: list[tuple[int, MTPSeq, int]] = []  # (index, record, drafts wanted)
        for i, seq in enumerate(seqs):
            rec = self.seqs.get(seq.seq_id)
            if rec is None:
                continue
            rec.keep_before(seq.num_computed_tokens)  # rows past it verified rejected drafts
            if rec.hidden_end != seq.num_computed_tokens or rec.hidden_start >= rec.hidden_end:
                continue  # no hidden state for its last computed position (not in step with the target)
            rec.token_ids += seq.token_ids[1 + len(rec.token_ids):seq.num_tokens]
            room = min(k, seq.max_tokens - seq.num_output_tokens - 1)
            # Blocks for the chained positions, which the verify step then uses too (never by preempting).
            if room > 0 and self.scheduler._grow(seq, 1 + room):
                work.append((i, rec, room))
        if not work:
            return drafts
        out, logits = self._catch_up([rec for _, rec, _ in work])
        known = {i: rec.num_tokens for i, rec, _ in work}
        for (i, _, _), row in zip(work, logits.argmax(dim=-1).tolist()):
            drafts[i].append(row)
        per_seq = {i: [logits[j]] for j, (i, _, _) in enumerate(work)}
        live = list(range(len(work)))
        try:
            for step in range(1, max(room for _, _, room in work)):
                live = [j for j in live if work[j][2] > step]
                items = []
                for j in live:
                    i, rec, _ = work[j]
                    rec.token_ids.append(drafts[i][-1])  # read by this pass only (taken off below)
                    items.append(ScheduledSeq(rec, 1, 1))
                new = self._pass(items, out[live])
                step_logits = self.target.compute_logits(new)
                out[live] = new
                for j, t, lg in zip(live, step_logits.argmax(dim=-1).tolist(), step_logits):
                    drafts[work[j][0]].append(t)
                    per_seq[work[j][0]].append(lg)
                    work[j][1].num_computed_tokens += 1
        finally:
            for i, rec, _ in work:
                del rec.token_ids[known[i]:]
                rec.num_computed_tokens = known[i]  # the chained indices are redone from the target's states
        if self.keep_logits:
            self.last_logits = {seqs[i].seq_id: torch.stack(per_seq[i]) for i, _, _ in work}
        return drafts

    def _catch_up(self, recs: list[MTPSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the head over each record's pending rows (in passes of at most max_tokens_per_pass tokens);
        returns, per record, the head's output at its last index [R, H] and the logits there [R, vocab]."""
        last: list[torch.Tensor | None] = [None] * len(recs)
        todo = list(range(len(recs)))
        while todo:
            budget, items, rows, done, taken = self.max_tokens_per_pass, [], [], [], []
            for r in todo:
                rec = recs[r]
                n = min(rec.num_tokens - rec.num_computed_tokens, budget)
                if n <= 0:
                    break
                budget -= n
                items.append(ScheduledSeq(rec, n, 1))
                rows.append(rec.take_rows()[:n])
                taken.append((r, n))
            out = self._pass(items, torch.cat(rows) if len(rows) > 1 else rows[0])
            for (r, n), o in zip(taken, out):
                recs[r].consumed(n)
                if recs[r].num_computed_tokens == recs[r].num_tokens:
                    last[r] = o
                    done.append(r)
            todo = [r for r in todo if r not in done]
        out = torch.stack(last)
        return out, self.target.compute_logits(out)
