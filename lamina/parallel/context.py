"""ParallelContext: which tensor-parallel rank this process is, and the collectives its layers use.

No module-level state: the context is made once per process (the engine core for rank 0, each worker for its
rank), passed to the model build, and carried by the weight formats that need a collective (row-parallel
linears all-reduce, the vocab-parallel embedding all-reduces, lm_head gathers). With world 1 every collective
is the identity and no process group exists, so a single-process model never pays for them.

The collectives are torch.distributed's (gloo on the CPU, NCCL on CUDA); a failure of a peer (its process
died, its socket closed) surfaces as ParallelFailure, which the engine treats as fatal rather than as one
request's failure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class ParallelFailure(RuntimeError):
    """The tensor-parallel group cannot run any more: a peer is gone, a collective with it failed, or a forward
    failed on one rank after the others started it (the ranks would be out of step)."""


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """rank/world of the tensor-parallel group; group: its torch.distributed ProcessGroup (None: world 1 or the
    default group). Sizes of partitioned dimensions must divide by `world` (checked at start-up)."""

    rank: int = 0
    world: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of {self.world}")

    @property
    def is_parallel(self) -> bool:
        return self.world > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (x itself returned)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as e:
            raise ParallelFailure(f"tensor-parallel all-reduce failed: {e}") from e
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] from every rank -> [..., world * n], rank order along the last dim (every rank gets it)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        try:
            dist.all_gather(parts, x, group=self.group)
        except RuntimeError as e:
            raise ParallelFailure(f"tensor-parallel all-gather failed: {e}") from e
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype on every rank), in place."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        try:
            dist.broadcast(x, src=0, group=self.group)
        except RuntimeError as e:
            raise ParallelFailure(f"tensor-parallel broadcast failed: {e}") from e
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values (every rank sizes its pools to what the tightest one fits)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as e:
            raise ParallelFailure(f"tensor-parallel all-reduce failed: {e}") from e
        return int(t.item())


SINGLE = ParallelContext()  # immutable: the single-process context
