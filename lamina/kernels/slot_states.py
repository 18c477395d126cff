"""Gather/scatter of per-sequence states (conv, recurrent) held in a pool tensor [num_slots, ...]."""
from __future__ import annotations

import torch


def read_states(pool: torch.Tensor | None, rows: list[int], slots: list[int] | None, has_init: list[bool],
                shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The states of sequences `rows` gathered from the pool (a copy), zeroed where a sequence starts fresh.

    pool or slots None (no pool bound, e.g. a profiling pass): all zeros.
    """
    if pool is None or slots is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    idx = torch.tensor([slots[i] for i in rows], device=pool.device)
    state = pool.index_select(0, idx).to(dtype)
    fresh = [j for j, i in enumerate(rows) if not has_init[i]]
    if fresh:
        state[fresh] = 0  # a sequence at position 0 must not see its slot's previous tenant
    return state


def write_states(pool: torch.Tensor | None, rows: list[int], slots: list[int] | None, state: torch.Tensor) -> None:
    if pool is None or slots is None:
        return
    idx = torch.tensor([slots[i] for i in rows], device=pool.device)
    pool.index_copy_(0, idx, state.to(pool.dtype))
