"""draft_model: a separate small model with the target's vocabulary drafts greedily, with its own KV pool
(the same block design: a KVCache and a BlockAllocator of its own, block tables per sequence) and its own
ModelRunner.

Each sequence the drafter serves has a DraftSeq: the drafter's computed length and block table over the
target sequence's tokens. A proposal first catches the drafter up on the sequence's known tokens (the whole
prompt the first time, after that the tokens accepted since), sampling the first draft from that chunk's
last row, then runs one-token passes for the rest. The drafter's KV of known tokens stays valid (tokens
never change), so a sequence keeps its blocks while it runs; they go back when it finishes or is preempted.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from lamina.cache.block_allocator import BlockAllocator
from lamina.cache.kv_cache import KVCache
from lamina.cache.state_layout import StateLayout
from lamina.engine.request import SeqStatus, Sequence
from lamina.engine.runner import ModelRunner
from lamina.engine.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from lamina.engine.engine import LLMEngine


class DraftSeq:
    """What the drafter's runner reads of a sequence: the target's tokens, the drafter's own progress."""

    def __init__(self, target: Sequence) -> None:
        self.target = target
        self.seq_id = target.seq_id
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.draft_token_ids: list[int] = []
        self.state_slot = None
        self.wants_prompt_logprobs = False
        self.status = SeqStatus.RUNNING

    @property
    def token_ids(self) -> list[int]:
        return self.target.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.target.token_ids)

    def needs_prompt_logprobs(self) -> bool:
        return False


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, kv: KVCache, block_size: int, device: torch.device,
                 max_tokens_per_pass: int) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.allocator = BlockAllocator(kv.num_blocks)
        self.runner = ModelRunner(model, block_size, device)
        self.max_tokens_per_pass = max_tokens_per_pass
        self.seqs: dict[int, DraftSeq] = {}

    @classmethod
    def build(cls, engine: LLMEngine, path: str) -> DraftModelProposer:
        from lamina.engine.build import load_model_and_tokenizer

        cfg = dataclasses.replace(engine.config, model=path, tokenizer=None, speculative_config=None,
                                  max_model_len=engine.max_model_len)
        mcfg, tok, model = load_model_and_tokenizer(cfg, engine.dtype, engine.device, progress=False)
        if mcfg.vocab_size != engine.model_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({mcfg.vocab_size} tokens) differs "
                             f"from the target's ({engine.model_config.vocab_size})")
        if tok is not None and engine.tokenizer is not None and tok.get_vocab() != engine.tokenizer.get_vocab():
            raise ValueError("speculative_config: the draft model's tokenizer differs from the target's")
        layout = StateLayout.collect(model.state_layers(), engine.dtype)
        if layout.has_slots:
            raise ValueError("speculative_config: a draft model with recurrent layers is not supported")
        # As many blocks as the target's pool: the drafter holds the same positions of the same sequences.
        kv = KVCache(layout.kv_specs, engine.kv_cache.num_blocks, engine.config.block_size, engine.device)
        layout.bind_kv(kv.views)
        return cls(model, kv, engine.config.block_size, engine.device, engine.config.max_num_batched_tokens)

    def _release(self, d: DraftSeq) -> None:
        self.allocator.free(d.block_table[::-1])
        d.block_table = []
        d.status = SeqStatus.FINISHED  # its block-table row may be reclaimed
        del self.seqs[d.seq_id]

    def _gc(self) -> None:
        """Drops the drafter's state of sequences that finished or were preempted (their blocks go back)."""
        for d in [d for d in self.seqs.values() if d.target.status != SeqStatus.RUNNING]:
            self._release(d)

    def _grow(self, d: DraftSeq, upto: int) -> bool:
        need = (upto + self.block_size - 1) // self.block_size - len(d.block_table)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        d.block_table = d.block_table + self.allocator.allocate(need)  # a new list: the runner resends it
        return True

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        self._gc()
        drafts: list[list[int]] = [[] for _ in seqs]
        budget = self.max_tokens_per_pass
        first: list[tuple[int, DraftSeq, int]] = []  # (index, draft seq, chunk length) of the catch-up pass
        for i, seq in enumerate(seqs):
            d = self.seqs.get(seq.seq_id)
            if d is None:
                d = self.seqs[seq.seq_id] = DraftSeq(seq)
            room = min(k, seq.max_tokens - seq.num_output_tokens - 1)
            n = seq.num_tokens - d.num_computed_tokens
            if room <= 0 or n > budget or not self._grow(d, seq.num_tokens - 1 + room):
                continue  # no drafts this step (its catch-up waits for a step with room)
            budget -= n
            first.append((i, d, n))
        if not first:
            return drafts
        room = {i: min(k, seqs[i].max_tokens - seqs[i].num_output_tokens - 1) for i, _, _ in first}
        known = {i: seqs[i].num_tokens for i, _, _ in first}
        appended = dict.fromkeys(room, 0)
        try:
            live = [(i, d) for i, d, _ in first]
            items = [ScheduledSeq(d, n, 1) for _, d, n in first]
            while live:
                logits = self.runner.execute(self.runner.prepare(items))
                for (i, _d), t in zip(live, logits.argmax(dim=-1).tolist()):
                    drafts[i].append(t)
                for item in items:
                    item.seq.num_computed_tokens += item.num_tokens
                live = [(i, d) for i, d in live if len(drafts[i]) < room[i]]
                for i, d in live:  # the next pass reads the newest draft (taken off again below)
                    d.target.token_ids.append(drafts[i][-1])
                    appended[i] += 1
                items = [ScheduledSeq(d, 1, 1) for _, d in live]
        finally:
            for i, d, _ in first:
                if appended[i]:
                    del d.target.token_ids[-appended[i]:]
                # Only the known tokens' KV is the drafter's for good; the drafts' positions are redone.
                d.num_computed_tokens = min(d.num_computed_tokens, known[i])
        return drafts
