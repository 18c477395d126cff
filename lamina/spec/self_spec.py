"""self_spec: the target model with some of its decoder layers skipped drafts for itself (no extra weights).

K draft passes of one token per sequence run embed -> the kept layers -> final norm -> lm_head, greedily
(the drafts are one-hot guesses, so acceptance stays lossless). The kept layers' attention reads the target's
own KV for the known positions and writes the drafter's KV at positions T-1 .. T+K-2 of each sequence (T
known tokens): the verify step rewrites every one of those positions, and KV at or past a sequence's computed
length is never read before it is rewritten, so the target never sees the drafter's values. Those positions
lie in blocks the sequence owns alone (never a prefix-cache block: those are full and computed), grown here
if needed; a sequence whose blocks do not fit gets no drafts (drafting never preempts).

On CUDA the draft passes replay decode graphs of their own (the kept layers only, captured once at start-up
into a private pool): eager passes of the built-in SmolLM2 (27 of 30 layers kept) cost ~7.6 ms per K = 3
round on an H200, where the target's graphed decode step is ~1 ms, which made self_spec 0.07x plain.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from lamina.engine.request import Sequence
from lamina.engine.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from lamina.engine.engine import LLMEngine


def default_skip_layers(num_layers: int) -> tuple[int, ...]:
    """Every second layer of the middle (the first and last layers stay: skipping them costs the most)."""
    return tuple(range(1, num_layers - 1, 2))


class KeptLayers(torch.nn.Module):
    """The target with only the drafter's layers: what the drafter's CUDA graphs capture (same weights)."""

    def __init__(self, target: torch.nn.Module, keep: list[int]) -> None:
        super().__init__()
        self.target, self.keep, self.config = target, tuple(keep), target.config

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        return self.target.hidden_states(input_ids, positions, ctx, self.keep)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


class SelfSpecProposer:
    def __init__(self, model: torch.nn.Module, runner, scheduler, keep: list[int], graphs=None) -> None:
        """graphs: a CudaGraphRunner over KeptLayers (decode graphs), or None (eager passes)."""
        self.model, self.runner, self.scheduler, self.keep = model, runner, scheduler, keep
        self.drafter = KeptLayers(model, keep)
        self.graphs = graphs

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
        proposer = cls(engine.model, engine.runner, engine.scheduler, keep)
        if engine.runner.graphs is not None and engine.tp is None:  # the target replays graphs: so does the drafter
            proposer.graphs = draft_graphs(proposer.drafter, engine)
        return proposer

    @torch.inference_mode()
    def _forward(self, batch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        hidden = self.drafter.hidden_states(batch.input_ids, batch.positions, batch.ctx)
        return self.drafter.compute_logits(hidden.index_select(0, batch.logits_indices))

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


def draft_graphs(drafter: KeptLayers, engine: LLMEngine):
    """Decode graphs (one token per sequence, every padded batch size) of the kept layers; None if the capture
    fails (the passes then run eagerly, as logged)."""
    from lamina.engine.cuda_graph import CudaGraphRunner

    graphs = CudaGraphRunner(drafter, engine.config.max_num_seqs, engine.max_model_len, engine.config.block_size,
                             engine.device, mixed=False)
    try:
        graphs.capture()
    except Exception:  # keep serving: the drafter runs eagerly
        logging.getLogger("lamina").exception("capturing self_spec's draft graphs failed: its passes run eagerly")
        torch.cuda.synchronize(engine.device)
        return None
    return graphs
