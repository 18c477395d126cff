"""The layers with linear-shaped weights: Linear (every projection, lm_head) and Embedding.

Neither owns its parameters: its weight format (lamina.models.weight_formats) creates them, loads checkpoint
tensors into them and applies them, so the modules that use these layers never know whether the weight is
dense, quantized, a tensor-parallel slice or carries LoRA deltas.

A fused projection is one Linear whose output features are named parts in order (q|k|v, gate|up, the GDN's
qkv|z|b|a): one matmul instead of several, which matters most for small-batch decode where each launch is
memory-bound. The checkpoint's separate tensors load into their parts by name.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lamina.kernels.gemv import env_dispatcher
from lamina.models.weight_formats import DenseFormat, WeightFormat
from lamina.models.weight_formats.base import clear_params


class _WithFormat(nn.Module):
    """A layer whose parameters are its weight format's: `in_features`, `out_shards`, `has_bias` describe
    the logical weight; `format` holds it."""

    in_features: int
    out_shards: dict[str, int]
    has_bias: bool

    def set_format(self, fmt: WeightFormat, dtype: torch.dtype | None = None) -> None:
        """(Re)creates the parameters in `fmt`'s storage; before loading, on the meta device."""
        clear_params(self)
        self.format = fmt
        fmt.create_params(self, self.in_features, self.out_shards, self.has_bias, dtype or torch.get_default_dtype())


class Linear(_WithFormat):
    """y = x W^T (+ b), W [out_features, in_features] in the format's storage.

    out_features: an int, or {part name: size} for a fused projection (sizes are the full, unpartitioned
    ones; the output is the parts concatenated in this order). fmt: the weight format (default dense)."""

    def __init__(self, in_features: int, out_features: int | Mapping[str, int], bias: bool = False,
                 fmt: WeightFormat | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_shards = dict(out_features) if isinstance(out_features, Mapping) else {"": out_features}
        self.has_bias = bias
        self.set_format(fmt or DenseFormat(), dtype)
        self.gemv = env_dispatcher()  # the Triton decode GEMV when LAMINA_TRITON_GEMV=1 (kernels/gemv.py)

    @property
    def out_features(self) -> int:
        return sum(self.out_shards.values())

    def tie_to(self, source: nn.Module) -> None:
        """Reads `source`'s weights (lm_head tied to the embedding); the format decides whether it can."""
        self.format.tie(self, source)

    def takes_prologue(self, x: torch.Tensor, act: bool = False) -> bool:
        """Whether forward(x, prologue=...) runs here: the Triton decode GEMV takes this call (dense,
        unpartitioned weight, CUDA, <= 16 rows; act: x is gate|up, twice the input width)."""
        return self.gemv is not None and type(self.format) is DenseFormat and self.format.partition is None \
            and self.gemv.accepts(x, self.weight, self.bias, act=act)

    def forward(self, x: torch.Tensor, prologue=None, epilogue=None) -> torch.Tensor:
        """prologue / epilogue (a triton_gemv.Prologue / Epilogue; only where takes_prologue said so): the norm
        or activation the decode GEMV applies to x before, or to y after, the products, in the same launch."""
        if prologue is not None or epilogue is not None or self.takes_prologue(x):  # decode rows, dense, CUDA
            return self.gemv(x, self.weight, self.bias, prologue, epilogue)
        return self.format.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_shards}, bias={self.has_bias}, format={self.format!r}"


class Embedding(_WithFormat):
    """Token embedding table [num_embeddings, embedding_dim]: the same weight layout as a Linear from
    embedding_dim to num_embeddings, so a format serves both, and lm_head can be tied to it."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: WeightFormat | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_shards, self.has_bias = embedding_dim, {"": num_embeddings}, False
        self.set_format(fmt or DenseFormat(), dtype)

    @property
    def num_embeddings(self) -> int:
        return self.out_shards[""]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.format.embed(self, ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.in_features}, format={self.format!r}"
