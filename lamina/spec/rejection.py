"""The general rejection-sampling rule for drafts that come with a distribution q (a sampling drafter):
draft d at position j is kept with probability min(1, p_j(d) / q_j(d)); at the first rejected position the
token is drawn from the normalized residual max(0, p_j - q_j); when all K stand, a bonus token is drawn from
p_K. The emitted tokens are then distributed exactly as sampling from p one token at a time.

Vectorized over a padded [B, K(+1), V] layout, on whatever device the inputs live; with q = None the drafts
are one-hot (the rule reduces to keeping d with probability p(d), and the residual is p without d).
"""
from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, uniform: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, K+1, V] (p at each draft position and the bonus position), draft_ids [B, K], num_drafts
    [B] (sequence b verifies its first num_drafts[b] drafts), draft_probs [B, K, V] or None (one-hot).
    uniform [B, K] in [0, 1) and noise [B, K+1, V] Exp(1) may be given (seeded rows); else drawn from
    `generator`. Returns (tokens [B, K+1] with -1 past each sequence's emitted tokens, num_accepted [B])."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    if uniform is None:
        uniform = torch.rand((b, k), generator=generator, device=dev)
    if noise is None:
        noise = torch.empty((b, k1, v), device=dev).exponential_(generator=generator)
    pos = torch.arange(k, device=dev)[None]
    d = draft_ids.clamp(0, v - 1)
    p_d = target_probs[:, :k].gather(2, d[..., None])[..., 0]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        residual = target_probs[:, :k].scatter(2, d[..., None], 0.0)
    else:
        q_d = draft_probs.gather(2, d[..., None])[..., 0]
        residual = (target_probs[:, :k] - draft_probs).clamp_min(0.0)
    keep = (uniform * q_d < p_d) & (pos < num_drafts[:, None])  # u < p/q without dividing by q = 0
    # Leading run of kept drafts: the first position that is not kept (num_drafts if all are).
    stop = torch.where(keep, k, pos.expand(b, k))
    num_accepted = torch.minimum(stop.min(dim=1).values, num_drafts)
    # Per position, the token emitted if the run stops there: the residual draw, or the bonus at num_drafts.
    final = torch.cat([residual, target_probs[:, k:]], dim=1)
    bonus_row = torch.nn.functional.one_hot(num_drafts, k1).bool()[..., None]
    final = torch.where(bonus_row, target_probs, final)  # stopping at num_drafts < K draws from p there
    drawn = (final / noise).argmax(dim=2)  # the exponential race: a draw from final's normalized distribution
    tokens = torch.cat([d, torch.zeros((b, 1), dtype=d.dtype, device=dev)], dim=1)
    pos1 = torch.arange(k1, device=dev)[None]
    at_stop = pos1 == num_accepted[:, None]
    tokens = torch.where(at_stop, drawn, tokens)
    tokens = torch.where(pos1 > num_accepted[:, None], -1, tokens)
    return tokens, num_accepted
