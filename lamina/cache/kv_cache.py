"""The paged KV pool: one allocation per attention layer, bound into the model's attention modules."""
from __future__ import annotations

import torch
from torch import nn

from lamina.models.layers.attention import Attention


class KVCache:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        for attn in self.layers:
            shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
            k = torch.zeros(shape, dtype=dtype, device=device)
            v = torch.zeros(shape, dtype=dtype, device=device)
            attn.k_cache, attn.v_cache = k, v
            self.tensors.append((k, v))

    @staticmethod
    def bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return sum(2 * block_size * m.num_kv_heads * m.head_dim * item
                   for m in model.modules() if isinstance(m, Attention))
