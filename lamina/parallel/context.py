"""ParallelContext: which tensor-parallel rank this process is, and the collectives its layers use.

No module-level state: the context is made once per process (the engine core for rank 0, each worker for its
rank), passed to the model build, and carried by the weight formats that need a collective (row-parallel
linears all-reduce, the vocab-parallel embedding all-reduces, lm_head gathers). With world 1 every collective
is the identity and no process group exists, so a single-process model never pays for them.

The collectives are torch.distributed's backends (gloo on the CPU, NCCL on CUDA); a failure of a peer (its process
died, its socket closed) surfaces as ParallelFailure, which the engine treats as fatal rather than as one
request's failure.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class ParallelFailure(RuntimeError):
    """The tensor-parallel group cannot run any more: a peer is gone, a collective with it failed, or a forward
    failed on one rank after the others started it (the ranks would be out of step)."""


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """rank/world of the tensor-parallel group. group: its torch.distributed backend (ProcessGroupGloo or
    ProcessGroupNCCL), made by `connect`, not registered as torch's default group (so nothing global: two
    engines could each hold one); store: its rendezvous store, kept alive with it. Both None for world 1.
    expert_parallel: MoE layers place whole experts across the ranks (parallel/expert_parallel.py)."""

    rank: int = 0
    world: int = 1
    group: Any = None
    store: Any = None
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of {self.world}")

    @property
    def is_parallel(self) -> bool:
        return self.world > 1

    def _wait(self, what: str, work: Callable[[], Any]) -> None:
        if self.group is None:
            raise ParallelFailure(f"tensor-parallel {what} without a process group (rank {self.rank} of {self.world})")
        try:
            work().wait()
        except RuntimeError as e:
            raise ParallelFailure(f"tensor-parallel {what} failed: {e}") from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks: x itself (summed in place), or a contiguous copy of a strided x."""
        if self.world > 1:
            x = x.contiguous()
            self._wait("all-reduce", lambda: self.group.allreduce([x]))
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] from every rank -> [..., world * n], rank order along the last dim (every rank gets it)."""
        if self.world == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._wait("all-gather", lambda: self.group.allgather([parts], [x]))
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype on every rank), in place."""
        if self.world > 1:
            import torch.distributed as dist

            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self._wait("broadcast", lambda: self.group.broadcast([x], opts))
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values (every rank sizes its pools to what the tightest one fits)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._wait("all-reduce", lambda: self.group.allreduce([t], opts))
        return int(t.item())


def connect(rank: int, world: int, port: int, device: torch.device, timeout: datetime.timedelta,
            host: str = "127.0.0.1") -> ParallelContext:
    """Joins the tensor-parallel group whose rank 0 listens on `host`:`port` (rank 0 hosts the store; another
    node's workers get its address, parallel/ray_workers.py): gloo on the CPU, NCCL on CUDA. Blocks until
    every rank has joined (or `timeout`)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout)
    if device.type == "cuda":
        group = dist.ProcessGroupNCCL(store, rank, world)
    else:
        group = dist.ProcessGroupGloo(store, rank, world, timeout)
    return ParallelContext(rank, world, group, store)


SINGLE = ParallelContext()  # immutable: the single-process context
