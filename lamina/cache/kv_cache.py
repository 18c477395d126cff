"""The paged KV pool: one allocation per KV layer, laid out as that layer's spec declares.

The pool only allocates: the engine binds `views` into the layers (StateLayout.bind_kv). The KV layers share
one block table, so block b is row b of every layer's allocation; except the layers of the window group
(`windowed`, cache/kv_groups.py), which have a table and `window_blocks` blocks of their own.
"""
from __future__ import annotations

import dataclasses

import torch

from lamina.cache.specs import BlockSpec, KVBlocks


class KVCache:
    def __init__(self, specs: list[BlockSpec], num_blocks: int, block_size: int, device: torch.device,
                 windowed: list[bool] | None = None, window_blocks: int = 0) -> None:
        self.specs, self.num_blocks, self.block_size = list(specs), num_blocks, block_size
        self.windowed = list(windowed) if windowed is not None else [False] * len(self.specs)
        self.window_blocks = window_blocks if any(self.windowed) else 0
        self.views = []
        for spec, w in zip(self.specs, self.windowed):
            view = spec.allocate(window_blocks if w else num_blocks, block_size, device)
            self.views.append(dataclasses.replace(view, windowed=True) if w else view)
        assert all(isinstance(v, KVBlocks) or not w for v, w in zip(self.views, self.windowed))

    @staticmethod
    def bytes_per_block(specs: list[BlockSpec], block_size: int) -> int:
        return sum(s.bytes_per_block(block_size) for s in specs)

    @property
    def nbytes(self) -> int:
        prim = [s for s, w in zip(self.specs, self.windowed) if not w]
        win = [s for s, w in zip(self.specs, self.windowed) if w]
        return (self.num_blocks * self.bytes_per_block(prim, self.block_size)
                + self.window_blocks * self.bytes_per_block(win, self.block_size))
