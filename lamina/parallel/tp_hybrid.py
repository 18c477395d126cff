"""Tensor parallelism for the hybrid families' mixers: Gated DeltaNet (Qwen3-Next, Qwen3.5), Mamba-2
(Nemotron-H, Bamba), and Nemotron-H's plain MLP. (Gated attention splits like attention: its q shard holds
[query | gate] per head, so a contiguous split of it gives each rank its heads with their gates.)

The split is by heads, as for attention, and each rank's state pool holds only its heads' state (the layer's
state_spec reads the local sizes set here; slots are rank 0's, parallel/state_ops.py):

- Gated DeltaNet: key heads split evenly (value heads follow, they are grouped per key head). in_proj is
  column-parallel with its qkv shard cut in three (q | k | v, each split on its own) and z, b, a split as
  they are (flat per-value-head layouts once families/qwen3_next.py has reordered Qwen3-Next's per-group
  in_proj_qkvz / in_proj_ba); the depthwise conv's channels are q | k | v too; A_log and dt_bias per value
  head; the gated norm is per head (its weight is one head's, replicated); out_proj row-parallel.
- Mamba-2: heads and B/C groups split evenly (groups must divide by the ranks: B/C replicated for fewer
  groups than ranks is not done). in_proj's output z | x | B | C | dt is cut in five, the conv's channels
  x | B | C in three; dt_bias, A_log, D per head; the grouped gated norm per group (group width unchanged,
  each rank holds its groups' weights); out_proj row-parallel.

The parameters no weight format owns (conv1d weight/bias, A_log, dt_bias, D, the norm weight) are replaced
by their local slice after the model is built, each with a loader that cuts it out of the full checkpoint
tensor (so the loader's missing-tensor check still applies).
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from lamina.models.config import ModelConfig
from lamina.models.weight_formats import Partition, WeightFormat
from lamina.models.weight_formats.base import copy_checked, register_param
from lamina.parallel.context import ParallelContext
from lamina.parallel.tp_formats import ColumnParallel, RowParallel

HYBRID_MIXERS = ("gated_attention", "gated_delta_net", "mamba2")
HYBRID_FFNS = ("plain",)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_hybrid_config(cfg: ModelConfig, world: int) -> list[tuple[str, int]]:
    """(name, size) pairs that must divide by `world` for the hybrid mixers `cfg` has; raises ValueError (one
    line) for a split not done."""
    mixers = {s.mixer for s in cfg.layers}
    checks: list[tuple[str, int]] = []
    if "gated_delta_net" in mixers:
        checks.append(("linear-attention key heads", cfg.gdn.num_k_heads))
    if "mamba2" in mixers:
        m = cfg.mamba2
        if m.n_groups % world:
            raise ValueError(f"--tensor-parallel-size {world}: the model's {m.n_groups} Mamba-2 B/C groups do not "
                             f"divide by {world} (replicating B/C over ranks is not done yet)")
        checks.append(("Mamba-2 heads", m.num_heads))
    return checks


class SplitColumnParallel(ColumnParallel):
    """Column-parallel where a fused shard (or an unfused layer's whole output, key "") is itself a
    concatenation of pieces, each split over the ranks on its own: rank r holds [piece0_r | piece1_r | ...]."""

    def __init__(self, ctx: ParallelContext, pieces: Mapping[str, tuple[int, ...]]) -> None:
        super().__init__(ctx)
        self.pieces = {k: tuple(v) for k, v in pieces.items()}

    def __repr__(self) -> str:
        return f"SplitColumnParallel(rank={self.ctx.rank}, world={self.ctx.world}, pieces={self.pieces})"

    def _load(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None,
              expert: int | None, is_bias: bool) -> None:
        key = shard or ""
        sizes = self.pieces.get(key)
        if sizes is None or expert is not None or (shard is None and len(layer.out_shards) > 1):
            super()._load(layer, param, tensor, shard, expert, is_bias)  # a whole fused tensor comes back per shard
            return
        full = layer.out_shards[key]
        if sum(sizes) != full:
            raise ValueError(f"pieces {sizes} do not make up shard {key!r} of {full} rows")
        kind = "bias" if is_bias else "weight"
        what = f"shard {shard!r} of the {kind}" if shard else f"the {kind}"
        shape = (full,) if is_bias else (full, layer.in_features)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{what} expects shape {shape}, the checkpoint has {tuple(tensor.shape)}")
        target = param[self._rows(layer, key)] if len(layer.out_shards) > 1 else param
        copy_checked(target, take_pieces(self.partition, tensor, sizes), what)


def take_pieces(part: Partition, tensor: torch.Tensor, sizes: tuple[int, ...] | None) -> torch.Tensor:
    """This rank's slice of each piece of `tensor` (dim 0), concatenated; sizes None: one piece."""
    if sizes is None:
        return part.take(tensor, 0)
    return torch.cat([part.take(p, 0) for p in tensor.split(list(sizes))])


def split_param(module: nn.Module, name: str, ctx: ParallelContext, sizes: tuple[int, ...] | None = None) -> None:
    """Replaces `module`'s parameter `name` (no format owns it) by this rank's slice along dim 0, made of the
    given pieces (None: one), with a loader that cuts it out of the full checkpoint tensor."""
    full = getattr(module, name)
    if full is None:
        return
    part = Partition(ctx.rank, ctx.world, 0)
    full_shape = tuple(full.shape)
    local = (sum(part.local(s) for s in (sizes or full_shape[:1])), *full_shape[1:])

    def loader(layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
               expert: int | None = None) -> None:
        if shard is not None or expert is not None:
            raise ValueError("this parameter is one tensor; it has no parts")
        if tuple(tensor.shape) != full_shape:
            raise ValueError(f"the parameter expects shape {full_shape}, the checkpoint has {tuple(tensor.shape)}")
        copy_checked(param, take_pieces(part, tensor, sizes), "the parameter")

    param = nn.Parameter(torch.empty(local, dtype=full.dtype, device=full.device), requires_grad=False)
    register_param(module, name, param, loader)


def hybrid_format(ctx: ParallelContext, cfg: ModelConfig, name: str) -> WeightFormat | None:
    """The format of a hybrid mixer's (or plain MLP's) layer `name`, or None when it is no such layer."""
    role = name.rpartition(".")[2]
    if role == "up_proj":
        return ColumnParallel(ctx)
    found = _LAYER.search(name)
    mixer = cfg.layers[int(found.group(1))].mixer if found else None
    if mixer not in ("gated_delta_net", "mamba2") or role not in ("in_proj", "out_proj"):
        return None
    if role == "out_proj":
        return RowParallel(ctx)
    if mixer == "gated_delta_net":
        g = cfg.gdn
        kd, vd = g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim
        return SplitColumnParallel(ctx, {"qkv": (kd, kd, vd)})
    m = cfg.mamba2
    gn = m.n_groups * m.state_size
    return SplitColumnParallel(ctx, {"": (m.intermediate_size, m.intermediate_size, gn, gn, m.num_heads)})


def shard_state_mixers(model: nn.Module, ctx: ParallelContext) -> None:
    """Each Gated DeltaNet / Mamba-2 layer: its local sizes (its forward and state_spec read them) and its
    unformatted parameters cut to this rank's slice."""
    from lamina.models.layers.gated_delta_net import GatedDeltaNet
    from lamina.models.layers.mamba2 import Mamba2Mixer

    w = ctx.world
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            split_param(m.conv1d, "weight", ctx, (m.key_dim, m.key_dim, m.value_dim))
            split_param(m, "A_log", ctx)
            split_param(m, "dt_bias", ctx)
            m.num_k_heads //= w
            m.num_v_heads //= w
            m.key_dim //= w
            m.value_dim //= w
            m.conv_dim //= w
        elif isinstance(m, Mamba2Mixer):
            gn = m.n_groups * m.state_size
            for p in ("weight", "bias"):
                split_param(m.conv1d, p, ctx, (m.intermediate, gn, gn))
            for p in ("A_log", "dt_bias", "D"):
                split_param(m, p, ctx)
            split_param(m.norm, "weight", ctx)
            m.num_heads //= w
            m.n_groups //= w
            m.intermediate //= w
            m.conv_dim //= w
