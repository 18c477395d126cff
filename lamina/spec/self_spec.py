"""self_spec: the target model with some of its decoder layers skipped drafts for itself (no extra weights).

K draft passes of one token per sequence run embed -> the kept layers -> final norm -> lm_head, greedily
(the drafts are one-hot guesses, so acceptance stays lossless). The kept layers' attention reads the target's
own KV for the known positions and writes the drafter's KV at positions T-1 .. T+K-2 of each sequence (T
known tokens): the verify step rewrites every one of those positions, and KV at or past a sequence's computed
length is never read before it is rewritten, so the target never sees the drafter's values. Those positions
lie in blocks the sequence owns alone (never a prefix-cache block: those are full and computed), grown here
if needed; a sequence whose blocks do not fit gets no drafts (drafting never preempts).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lamina.engine.request import Sequence
from lamina.engine.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from lamina.engine.engine import LLMEngine


def default_skip_layers(num_layers: int) -> tuple[int, ...]:
    """Every second layer of the middle (the first and last layers stay: skipping them costs the most)."""
    return tuple(range(1, num_layers - 1, 2))


class SelfSpecProposer:
    def __init__(self, model: torch.nn.Module, runner, scheduler, keep: list[int]) -> None:
        self.model, self.runner, self.scheduler, self.keep = model, runner, scheduler, keep

    @classmethod
    def build(cls, engine: LLMEngine, skip_layers: tuple[int, ...] | None) -> SelfSpecProposer:
        n = len(engine.model.model.layers)
        skip = default_skip_layers(n) if skip_layers is None else skip_layers
        bad = [i for i in skip if i >= n]
        if bad:
            raise ValueError(f"speculative_config: skip_layers {bad} out of range (the model has {n} layers)")
        keep = [i for i in range(n) if i not in set(skip)]
        if not keep:
            raise ValueError("speculative_config: skip_layers leaves no layer for the drafter")
        return cls(engine.model, engine.runner, engine.scheduler, keep)

    @torch.inference_mode()
    def _forward(self, batch) -> torch.Tensor:
        body = self.model.model
        x, residual = body.embed_tokens(batch.input_ids), None
        for i in self.keep:
            x, residual = body.layers[i](x, residual, batch.positions, batch.ctx)
        x, _ = body.norm(x, residual)
        return self.model.compute_logits(x.index_select(0, batch.logits_indices))

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        room = [min(k, s.max_tokens - s.num_output_tokens - 1) for s in seqs]
        # Blocks for the positions the drafter and then the verify step write (never by preempting).
        live = [i for i, s in enumerate(seqs) if room[i] > 0 and self.scheduler._grow(s, 1 + room[i])]
        starts = {i: seqs[i].num_computed_tokens for i in live}
        try:
            for j in range(max((room[i] for i in live), default=0)):
                live = [i for i in live if room[i] > j]
                items = []
                for i in live:
                    seq = seqs[i]
                    # The pass reads token T-1+j: the last known token, then the drafts so far (appended for
                    # the pass only, and taken off again below).
                    seq.num_computed_tokens = starts[i] + j
                    if j:
                        seq.token_ids.append(drafts[i][-1])
                    items.append(ScheduledSeq(seq, 1, 1))
                batch = self.runner.prepare(items)
                for i, t in zip(live, self._forward(batch).argmax(dim=-1).tolist()):
                    drafts[i].append(t)
        finally:
            for i, start in starts.items():
                seq = seqs[i]
                extra = seq.num_computed_tokens - start
                if extra:
                    del seq.token_ids[-extra:]
                seq.num_computed_tokens = start
        return drafts
