"""Turns logits rows and sampler results into vLLM-shaped logprob dicts (token id -> Logprob)."""
from __future__ import annotations

import torch

from lamina.engine.detokenizer import Detokenizer
from lamina.engine.request import Sequence
from lamina.engine.sampler import SamplerOutput
from lamina.outputs import Logprob, PositionLogprobs


def sample_logprobs(result: SamplerOutput, row: int, token: int, detok: Detokenizer) -> PositionLogprobs:
    entry = {token: Logprob(result.chosen_logprobs[row], result.chosen_ranks[row], detok.token_text(token))}
    if result.top_ids is not None:
        for rank, (tid, lp) in enumerate(zip(result.top_ids[row], result.top_logprobs[row]), start=1):
            entry.setdefault(tid, Logprob(lp, rank, detok.token_text(tid)))
    return entry


def prompt_logprobs_for_chunk(seq: Sequence, rows: torch.Tensor, start: int, top_n: int,
                              detok: Detokenizer) -> None:
    """rows[i] are the logits at position start + i; they score prompt token start + i + 1."""
    assert seq.prompt_logprobs is not None
    if start == 0 and not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # the first prompt token has no context to be scored from
    n = min(rows.shape[0], seq.num_prompt_tokens - 1 - start)
    if n <= 0:
        return
    lp = rows[:n].float().log_softmax(dim=-1)
    targets = torch.tensor(seq.token_ids[start + 1:start + 1 + n], device=lp.device)
    chosen = lp.gather(1, targets[:, None])
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    top_lp, top_ids = lp.topk(top_n, dim=-1) if top_n > 0 else (None, None)
    top_lp = top_lp.tolist() if top_lp is not None else None
    top_ids = top_ids.tolist() if top_ids is not None else None
    for i in range(n):
        if start + 1 + i < len(seq.prompt_logprobs):
            continue  # already scored before a preemption sent this sequence back for recompute
        tok = seq.token_ids[start + 1 + i]
        entry = {tok: Logprob(chosen[i], ranks[i], detok.token_text(tok))}
        if top_ids is not None:
            for rank, (tid, v) in enumerate(zip(top_ids[i], top_lp[i]), start=1):
                entry.setdefault(tid, Logprob(v, rank, detok.token_text(tid)))
        seq.prompt_logprobs.append(entry)
