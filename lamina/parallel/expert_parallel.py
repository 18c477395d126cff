"""Expert parallelism: a MoE layer's routed experts placed whole across the tensor-parallel ranks.

`--enable-expert-parallel` (LLM(..., enable_expert_parallel=True)) with `--tensor-parallel-size N`: rank r
holds experts [r*E/N, (r+1)*E/N) (contiguous ranges: a global id becomes a local one by one subtraction and
a range test, a stacked checkpoint tensor is cut by one narrow along its expert dim, and the placement is
vLLM's default linear one). The router stays replicated, so every rank routes every token the same way.

Dispatch. Under tensor parallelism every rank holds every token (attention is TP, not data-parallel), so no
token has to travel: each rank runs its local experts on the pairs routed to them (the others' ids become
the sentinel E_local, which the fused kernels skip: kernels/moe.py) and the partial outputs are summed by
one all-reduce. That is what all-gather + reduce-scatter would do here: the all-gather would bring each
rank the tokens it already has, and a reduce-scatter followed by the next layer's all-gather (attention
needs every token on every rank) is an all-reduce. An all-to-all dispatch pays off once attention is
data-parallel (each rank holds only its own tokens): then tokens are sent to their experts' ranks and
back, moving T*k/N rows instead of all-reducing T rows, and the counts would have to travel first.

Load balance: rank 0 sees every routing decision, so it counts the pairs each rank's experts get
(`ExpertLoad`, summed over layers) on the device, without a host sync; the engine reads it at stats time
(EngineStats.expert_parallel_routed_tokens, the lamina:expert_parallel_routed_tokens metric, bench output).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from lamina.kernels.moe import fused_moe
from lamina.models.config import ModelConfig
from lamina.models.weight_formats.base import copy_checked, new_param, register_param
from lamina.models.weight_formats.dense import DenseExperts
from lamina.parallel.context import ParallelContext

log = logging.getLogger("lamina")


def check_ep_config(cfg: ModelConfig, world: int, enabled: bool, warn: bool = False) -> bool:
    """Whether expert parallelism applies: False for a model without routed experts (vLLM ignores the flag
    there too; warn: say so in one log line) or for one rank; ValueError (one line) when the experts do not
    divide by the ranks or are quantized."""
    if not enabled or world == 1 or cfg.moe is None:
        if enabled and warn:
            log.warning("--enable-expert-parallel ignored: %s", "tensor-parallel size 1 (one rank holds every "
                        "expert)" if world == 1 else f"{cfg.family} has no routed experts")
        return False
    if cfg.moe.num_experts % world:
        raise ValueError(f"--enable-expert-parallel: the model's {cfg.moe.num_experts} routed experts do not "
                         f"divide by --tensor-parallel-size {world} (each rank holds the same number)")
    if cfg.quantization_config is not None:
        raise ValueError("--enable-expert-parallel: expert parallelism needs dense (unquantized) experts")
    return True


class ExpertLoad:
    """(token, expert) pairs routed to each rank's experts, summed over the MoE layers, kept on the device.

    `add` runs inside the forward (no host sync; a CUDA graph may capture it once the counter exists); `read`
    is for stats time: on CUDA it returns the values of the last finished device-to-host copy and starts the
    next one (so a stats call never waits for the step in flight; the numbers lag by about one step)."""

    def __init__(self, world: int, experts_per_rank: int) -> None:
        self.world, self.per_rank = world, experts_per_rank
        self.counts: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._last = [0] * world

    def add(self, ids: torch.Tensor) -> None:
        """ids: the global expert ids [T, k] of one layer's routing."""
        if self.counts is None or self.counts.device != ids.device:
            if ids.is_cuda and torch.cuda.is_current_stream_capturing():
                return  # never allocate inside a capture (the warm-up's eager steps allocate first)
            self.counts = torch.zeros(self.world, dtype=torch.int64, device=ids.device)
        flat = ids.reshape(-1)
        self.counts.scatter_add_(0, flat // self.per_rank, torch.ones_like(flat))

    def reset(self) -> None:
        """Forget what start-up's warm-up and profiling forwards routed."""
        if self.counts is not None:
            self.counts.zero_()
        self._last, self._copied = [0] * self.world, None

    def read(self, wait: bool = False) -> list[int]:
        """The per-rank counts; wait: exact now (a host sync: for benchmarks, not the step loop)."""
        if self.counts is None:
            return list(self._last)
        if wait or not self.counts.is_cuda:
            return self.counts.tolist()
        if self._copied is not None and self._copied.query():
            self._last, self._copied = self._host.tolist(), None
        if self._copied is None:
            if self._host is None:
                self._host = torch.empty(self.world, dtype=torch.int64, pin_memory=True)
            self._host.copy_(self.counts, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return list(self._last)


class EPExperts(DenseExperts):
    """This rank's whole experts, stacked: gate_up_proj [E/N, 2I, H], down_proj [E/N, H, I] (global expert e
    in local slot e - first). Loaders take global expert indices and skip the other ranks' experts; `parts`
    lists only the local ones, so the missing-tensor check asks for exactly what this rank holds. apply maps
    the global top-k ids to local ones (remote -> sentinel E/N: contributes zero), runs the usual fused
    kernels and all-reduces the partial sums."""

    def __init__(self, ctx: ParallelContext, load: ExpertLoad | None = None) -> None:
        self.ctx, self.load = ctx, load
        self.first = self.local = 0

    def __repr__(self) -> str:
        return f"EPExperts(rank={self.ctx.rank}, experts=[{self.first}, {self.first + self.local}))"

    def create_params(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                      dtype: torch.dtype) -> None:
        if num_experts % self.ctx.world:
            raise ValueError(f"{num_experts} experts do not split over {self.ctx.world} expert-parallel ranks")
        self.local = num_experts // self.ctx.world
        self.first = self.ctx.rank * self.local
        mine = range(self.first, self.first + self.local)
        register_param(layer, "gate_up_proj", new_param((self.local, 2 * intermediate, hidden), dtype),
                       self._load_gate_up, tuple(f"{i}.{s}" for i in mine for s in ("gate", "up")))
        register_param(layer, "down_proj", new_param((self.local, hidden, intermediate), dtype),
                       self._load_down, tuple(str(i) for i in mine))

    def _mine(self, layer: nn.Module, expert: int) -> bool:
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} is out of range (the config has {layer.num_experts})")
        return self.first <= expert < self.first + self.local

    def _slot(self, layer: nn.Module, param: torch.Tensor, expert: int) -> torch.Tensor:
        return param[expert - self.first]

    def _load_gate_up(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                      expert: int | None = None) -> None:
        if expert is None:
            if shard is not None:
                raise ValueError(f"shard {shard!r} of the stacked experts needs an expert index")
            _full(tensor, (layer.num_experts, *param.shape[1:]), "the stacked gate|up experts")
            copy_checked(param, tensor.narrow(0, self.first, self.local), "the stacked gate|up experts")
        elif self._mine(layer, expert):
            super()._load_gate_up(layer, param, tensor, shard, expert)

    def _load_down(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                   expert: int | None = None) -> None:
        if expert is None:
            if shard is not None:
                raise ValueError(f"the down projection has no shard {shard!r}")
            _full(tensor, (layer.num_experts, *param.shape[1:]), "the stacked down experts")
            copy_checked(param, tensor.narrow(0, self.first, self.local), "the stacked down experts")
        elif self._mine(layer, expert):
            super()._load_down(layer, param, tensor, shard, expert)

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global ids -> local slots; another rank's expert -> the sentinel `local` (kernels/moe.py)."""
        ids = topk_ids - self.first
        return ids.masked_fill_((ids < 0) | (ids >= self.local), self.local)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if self.load is not None:
            self.load.add(topk_ids)
        out = fused_moe(x, layer.gate_up_proj, layer.down_proj, topk_weights, self.local_ids(topk_ids),
                        remote_pairs=True)
        return self.ctx.all_reduce(out)

    def fold_in(self, layer: nn.Module, gate_up: nn.Module, down: nn.Module) -> bool:
        return False  # a shared expert stays a tensor-parallel MLP of its own


def expert_format(ctx: ParallelContext, cfg: ModelConfig, enabled: bool):
    """A factory of each MoE layer's expert format: EPExperts sharing one ExpertLoad (counted on rank 0) when
    expert parallelism applies, else None (the caller's tensor-parallel experts)."""
    if not check_ep_config(cfg, ctx.world, enabled):
        return None
    load = ExpertLoad(ctx.world, cfg.moe.num_experts // ctx.world) if ctx.rank == 0 else None
    return lambda: EPExperts(ctx, load)


def expert_load(model: nn.Module) -> ExpertLoad | None:
    """The model's ExpertLoad (rank 0 under expert parallelism), else None."""
    for m in model.modules():
        load = getattr(getattr(m, "format", None), "load", None)
        if isinstance(load, ExpertLoad):
            return load
    return None


def _full(tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{what} expects shape {shape}, the checkpoint has {tuple(tensor.shape)}")
