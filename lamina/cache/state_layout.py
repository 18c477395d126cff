"""Which layers keep which per-sequence state, as they declared it, and the bind step that hands them views.

The engine builds one StateLayout from the model's stateful layers, sizes the pools from its specs, allocates
them (KVCache, StatePool) and calls bind_kv / bind_slots. Binding is the only way state reaches a layer, and
rebinding (e.g. profiling with scratch KV, then the real pool) goes through the same call.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from lamina.cache.specs import (
    BLOCK_SPECS,
    BlockSpec,
    FullAttentionSpec,
    LatentAttentionSpec,
    RecurrentStateSpec,
    SlotSpec,
    Stateful,
)


@dataclass
class StateLayout:
    kv_layers: list[Stateful] = field(default_factory=list)
    kv_specs: list[BlockSpec] = field(default_factory=list)
    slot_layers: list[Stateful] = field(default_factory=list)
    slot_specs: list[SlotSpec] = field(default_factory=list)

    @classmethod
    def collect(cls, layers: Iterable[Stateful], dtype: torch.dtype,
                kv_dtype: torch.dtype | None = None) -> StateLayout:
        """Asks each layer for its spec (dtype: the model's); layers answering None keep no state.

        kv_dtype: the KV pool's storage dtype when it differs from the model's (--kv-cache-dtype fp8): K/V
        specs are declared in it, so the pool is sized by their bytes and the kernels read the dtype off
        the bound tensors (layers need not know)."""
        out = cls()
        for layer in layers:
            spec = layer.state_spec(dtype)
            if spec is None:
                continue
            if kv_dtype is not None and isinstance(spec, (FullAttentionSpec, LatentAttentionSpec)):
                spec = dataclasses.replace(spec, dtype=kv_dtype)
            if isinstance(spec, BLOCK_SPECS):
                out.kv_layers.append(layer)
                out.kv_specs.append(spec)
            elif isinstance(spec, RecurrentStateSpec):
                out.slot_layers.append(layer)
                out.slot_specs.append(spec)
            else:
                raise TypeError(f"unknown state spec {spec!r}")
        return out

    @property
    def has_slots(self) -> bool:
        return bool(self.slot_specs)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of the shared block table takes over all KV layers."""
        return sum(s.bytes_per_block(block_size) for s in self.kv_specs)

    def bytes_per_slot(self) -> int:
        """Bytes one sequence slot (or one snapshot) takes over all recurrent-state layers."""
        return sum(s.bytes_per_slot for s in self.slot_specs)

    def bind_kv(self, views: list) -> None:
        """Binds KV views (KVCache.views, in kv_specs order) into their layers."""
        if len(views) != len(self.kv_layers):
            raise ValueError(f"{len(views)} KV views for {len(self.kv_layers)} KV layers")
        for layer, view in zip(self.kv_layers, views):
            layer.bind_state(view)

    def bind_slots(self, views: list) -> None:
        """Binds state-slot views (StatePool.views, in slot_specs order) into their layers."""
        if len(views) != len(self.slot_layers):
            raise ValueError(f"{len(views)} state views for {len(self.slot_layers)} state layers")
        for layer, view in zip(self.slot_layers, views):
            layer.bind_state(view)
