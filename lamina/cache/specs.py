"""State specs: what per-sequence state a mixer needs, declared by the mixer, allocated by the engine.

A mixer with per-sequence state implements `state_spec(dtype)` (dtype: the dtype the model runs at) and
`bind_state(view)`. The engine collects the specs of all layers (cache/state_layout.py), sizes and allocates
the pools from them (KV blocks: cache/kv_cache.py; state slots: cache/state_pool.py) and hands each layer the
view of its own allocation through `bind_state`. Pools never look at layer classes and never assign into
modules; layers never allocate their state.

Two families of state:
  - BlockSpec: paged, per token, leased in fixed-size blocks through the block table (full attention, sliding
    window attention, a latent MLA cache). The KV layers share one block table, so the pool's bytes per
    block is the sum over these specs; except that a model mixing sliding-window with full layers gives the
    sliding ones a block table and pool of their own (cache/kv_groups.py).
  - SlotSpec: fixed size per sequence, one slot per sequence for its lifetime (recurrent state: any number of
    named tensors with their own shapes and dtypes). Snapshots and candidate states are further rows of the
    same declared tensors (cache/state_snapshots.py, StatePool.copy_slot).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- paged (per-block) state ---------------------------------------------------------------------------
@dataclass
class KVBlocks:
    """The view a full/sliding attention layer is bound to: k, v [num_blocks, block_size, num_kv_heads, D].
    windowed: the view is a block of the window group's pool (cache/kv_groups.py): the layer addresses it
    through AttentionMetadata.window, not the primary block tables."""

    k: torch.Tensor
    v: torch.Tensor
    windowed: bool = False


@dataclass
class LatentBlocks:
    """The view a latent-attention (MLA) layer is bound to: kv [num_blocks, block_size, latent_dim + rope_dim]."""

    kv: torch.Tensor


@dataclass(frozen=True)
class FullAttentionSpec:
    """K and V of every past token, paged in blocks."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> KVBlocks:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return KVBlocks(torch.zeros(shape, dtype=self.dtype, device=device),
                        torch.zeros(shape, dtype=self.dtype, device=device))


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """K and V of the last `window` tokens. Laid out like full attention; the window is carried so that the
    blocks that fell out of the window go back to the pool (cache/sliding_window.py): from the one shared
    table when every KV layer is a sliding-window one, else from the window group's own (cache/kv_groups.py)."""

    window: int


@dataclass(frozen=True)
class LatentAttentionSpec:
    """A compressed latent (plus the decoupled RoPE key) per token, shared by all heads (MLA). Declared so a
    family can return it; no layer uses it yet."""

    latent_dim: int
    rope_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * (self.latent_dim + self.rope_dim) * _itemsize(self.dtype)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> LatentBlocks:
        shape = (num_blocks, block_size, self.latent_dim + self.rope_dim)
        return LatentBlocks(torch.zeros(shape, dtype=self.dtype, device=device))


BlockSpec = FullAttentionSpec | SlidingWindowSpec | LatentAttentionSpec
BLOCK_SPECS = (FullAttentionSpec, LatentAttentionSpec)  # isinstance targets (SlidingWindowSpec is a Full one)


# ---- per-slot (recurrent) state ------------------------------------------------------------------------
@dataclass(frozen=True)
class StateTensor:
    """One named tensor of a recurrent state: the shape of one sequence's copy, and its dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = _itemsize(self.dtype)
        for d in self.shape:
            n *= d
        return n


class SlotRows:
    """One layer's recurrent state over `num_rows` rows (sequence slots, snapshots, candidates): one tensor
    [num_rows, *shape] per declared StateTensor, in declaration order. Row addresses never move."""

    def __init__(self, spec: RecurrentStateSpec, num_rows: int, device: torch.device) -> None:
        self.spec, self.num_rows, self.device = spec, num_rows, device
        self.tensors: dict[str, torch.Tensor] = {
            t.name: torch.zeros((num_rows, *t.shape), dtype=t.dtype, device=device) for t in spec.tensors}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.tensors.values())

    def copy_row(self, dst: int, src_rows: SlotRows, src: int) -> None:
        """Row `dst` of self <- row `src` of src_rows (same spec), every declared tensor, stream-ordered."""
        for name, t in self.tensors.items():
            t[dst].copy_(src_rows.tensors[name][src], non_blocking=True)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A fixed-size state per sequence made of named tensors (e.g. gated delta net: conv window + recurrent
    state). A sequence leases one slot of it for its lifetime."""

    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a recurrent state needs distinct tensor names, got {names}")

    @property
    def bytes_per_slot(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def allocate(self, num_rows: int, device: torch.device) -> SlotRows:
        return SlotRows(self, num_rows, device)


SlotSpec = RecurrentStateSpec
StateSpec = BlockSpec | SlotSpec
StateView = KVBlocks | LatentBlocks | SlotRows


class Stateful(Protocol):
    """A layer that keeps per-sequence state: declares it, and takes the view the engine allocated for it."""

    def state_spec(self, dtype: torch.dtype) -> StateSpec | None: ...

    def bind_state(self, view: StateView) -> None: ...
