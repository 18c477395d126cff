"""The paged KV pool: one allocation per KV layer, laid out as that layer's spec declares.

The pool only allocates: the engine binds `views` into the layers (StateLayout.bind_kv). All KV layers share
one block table, so block b is row b of every layer's allocation.
"""
from __future__ import annotations

import torch

from lamina.cache.specs import BlockSpec


class KVCache:
    def __init__(self, specs: list[BlockSpec], num_blocks: int, block_size: int, device: torch.device) -> None:
        self.specs, self.num_blocks, self.block_size = list(specs), num_blocks, block_size
        self.views = [s.allocate(num_blocks, block_size, device) for s in self.specs]

    @staticmethod
    def bytes_per_block(specs: list[BlockSpec], block_size: int) -> int:
        return sum(s.bytes_per_block(block_size) for s in specs)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block(self.specs, self.block_size)
