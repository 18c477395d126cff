"""Tensor parallelism for multi-head latent attention (DeepSeek-V2/V3, layers/mla.py): heads split.

- q_a_proj and kv_a_proj_with_mqa (the down-projections to the query and KV latents, and the shared rope
  key) are replicated: their outputs are per token, not per head, and every rank needs all of them.
- q_b_proj (or q_proj without a query latent) and kv_b_proj (the up-projections, [per head: nope | pe] and
  [per head: K_nope | V]) are column-parallel by head: rank r's rows are its H/N heads, whole.
- o_proj is row-parallel (its input is the heads' outputs), so its partial sums are all-reduced.
The latent cache holds kv_lora_rank + qk_rope_head_dim values per token, shared by every head, so every
rank keeps the full latent cache of every sequence (the same bytes on each rank; only the per-head work is
split): MLA's KV memory does not shrink with N, its attention FLOPs and up-projection weights do.
The absorbed decode weights (W_UK, W_UV) are derived from the local kv_b_proj, hence local heads only.
"""
from __future__ import annotations

from torch import nn

from lamina.parallel.context import ParallelContext

MLA_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa")
MLA_COLUMN = ("q_proj", "q_b_proj", "kv_b_proj")


def shard_mla_heads(model: nn.Module, ctx: ParallelContext) -> None:
    """Each latent-attention layer computes its rank's num_heads / world heads."""
    from lamina.models.layers.mla import LatentAttention

    for m in model.modules():
        if isinstance(m, LatentAttention):
            if m.num_heads % ctx.world:
                raise ValueError(f"{m.num_heads} MLA heads do not split over {ctx.world} ranks")
            m.num_heads //= ctx.world
