"""FP8 (e4m3) weights for linear layers: checkpoints with block scales, row scales or per-tensor scales, and
bf16/fp32 checkpoints quantized while they stream in.

Storage: `weight` float8_e4m3fn [out, in] and one fp32 scale parameter, named after the checkpoint's:
- block scales (`Fp8Scheme.block=(bn, bk)`; quant_method "fp8" with weight_block_size, or compressed-tensors
  strategy "block"): `weight_scale_inv` (or `weight_scale`) [ceil(out/bn), ceil(in/bk)], w = q * scale
  blockwise. A fused projection's shards each bring their own scale rows, so every shard must be a multiple
  of bn rows (else one block would straddle two shards' scales).
- row scales (compressed-tensors "channel", [out, 1]) and per-tensor scales ("tensor", one per shard; the
  older quant_method "fp8" without blocks): `weight_scale` [out]; a per-tensor scale is written into every
  row of its shard, which dequantizes identically and lets fused q|k|v shards keep different scales.
- online (`online=True`): the checkpoint's dense weight is quantized per row as it loads; the scales are a
  buffer (derived, not expected from the checkpoint).
- static activation scales (`static_input=True`): `input_scale` [number of shards]; the fused layer uses the
  largest (the shards share one input, and the largest scale clips none of them).
The matmul is kernels.fp8.fp8_linear (reference on the CPU, Triton/_scaled_mm on CUDA).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lamina.kernels.fp8 import FP8, fp8_linear, quantize_rows
from lamina.models.weight_formats.base import Cut, WeightFormat, copy_checked, new_param, register_param


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint stores its FP8 weights (see the module docstring)."""

    block: tuple[int, int] | None = None  # None: one scale per output row
    scale_name: str = "weight_scale_inv"  # the checkpoint's name of the scale tensor (block scales)
    static_input: bool = False  # the checkpoint carries input_scale (static activation quantization)
    online: bool = False  # dense checkpoint, quantized at load

    def __post_init__(self) -> None:
        if self.block is not None:
            check_block(self.block)

    @property
    def scale_param(self) -> str:
        return self.scale_name if self.block is not None and not self.online else "weight_scale"


SUPPORTED_BLOCKS = "[bn, bk] with bn and bk powers of two >= 16 (e.g. [128, 128])"


def check_block(block) -> tuple[int, int]:
    """The block size as a pair, or a one-line refusal naming what is supported."""
    ok = isinstance(block, (list, tuple)) and len(block) == 2 and all(
        isinstance(b, int) and b >= 16 and not b & (b - 1) for b in block)
    if not ok:
        raise ValueError(f"unsupported FP8 weight block size {block!r}; supported: {SUPPORTED_BLOCKS}")
    return int(block[0]), int(block[1])


def shard_rows(out_shards: Mapping[str, int], shard: str | None) -> slice:
    """The rows of fused part `shard` (None: every row)."""
    if shard is None:
        return slice(None)
    start = 0
    for name, size in out_shards.items():
        if name == shard:
            return slice(start, start + size)
        start += size
    named = [n for n in out_shards if n]
    raise ValueError(f"no shard {shard!r}" + (f" (its shards: {', '.join(named)})" if named else
                                             " (the layer is not fused)"))


def fill_row_scale(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    """Row scales from a checkpoint's per-tensor scale (one number) or per-channel scales ([n] or [n, 1])."""
    t = tensor.detach().float()
    if t.numel() == 1:
        target.fill_(t.reshape(()).item())
    elif t.dim() in (1, 2) and t.shape[0] == target.shape[0] and t.numel() == target.shape[0]:
        target.copy_(t.reshape(-1))
    else:
        raise ValueError(f"{what} expects one scale or {target.shape[0]} (one per row), the checkpoint has "
                         f"shape {tuple(tensor.shape)}")


def store_fp8(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    """A checkpoint's FP8 weight into its rows (its dtype checked: a dense tensor would load unscaled)."""
    if tensor.dtype != FP8:
        raise ValueError(f"{what} expects a float8_e4m3fn tensor, the checkpoint has {tensor.dtype}")
    copy_checked(target, tensor, what)


def fp8_tp_slice(scheme: Fp8Scheme, kind: str, tensor: torch.Tensor, cut: Cut, what: str):
    """A rank's piece of one FP8 checkpoint tensor [out, in] (Linear and experts alike); kind: "weight",
    "block" (block scales: whole blocks only), "rows" (row or per-tensor scales), "input" (activation
    scales: whole), "bias". An online weight's row-parallel piece is returned quantized over its FULL rows,
    as (q, scale): a row scale from the rank's columns alone would differ from one process's."""
    if kind == "weight":
        if scheme.online and cut.dim == 1:
            q, scale = quantize_rows(tensor)
            return cut.along(q, 1, what=what), scale
        return cut.along(tensor, cut.dim, what=what)
    if kind == "block":
        unit = scheme.block[cut.dim]
        return cut.along(tensor, cut.dim, unit, what=what)
    if kind in ("rows", "bias"):
        if cut.dim == 1 or tensor.numel() == 1:
            return tensor
        return cut.along(tensor, 0, what=what)
    return tensor  # input scales: one per part, not split


class Fp8Linear(WeightFormat):
    """FP8 weight + scales (+ dense bias) for a Linear; see the module docstring."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def __repr__(self) -> str:
        return f"Fp8Linear({self.scheme})"

    def create_params(self, layer: nn.Module, in_features: int, out_shards: Mapping[str, int], bias: bool,
                      dtype: torch.dtype) -> None:
        s = self.scheme
        out = sum(out_shards.values())
        parts = tuple(n for n in out_shards if n)
        register_param(layer, "weight", new_param((out, in_features), FP8), self._load_weight, parts)
        if s.online:
            layer.register_buffer("weight_scale", torch.ones(out, dtype=torch.float32))
        elif s.block is not None:
            bn, bk = s.block
            uneven = [f"{n or 'the layer'}: {size}" for n, size in out_shards.items() if size % bn and len(parts) > 1]
            if uneven:
                raise ValueError(f"FP8 block size {bn} does not divide the rows of fused shards ({', '.join(uneven)})")
            shape = (-(-out // bn), -(-in_features // bk))
            register_param(layer, s.scale_name, new_param(shape, torch.float32), self._load_block_scale, parts)
        else:
            register_param(layer, "weight_scale", new_param((out,), torch.float32), self._load_row_scale, parts)
        if s.static_input:
            register_param(layer, "input_scale", new_param((max(len(parts), 1),), torch.float32),
                           self._load_input_scale, parts)
        if bias:
            register_param(layer, "bias", new_param((out,), dtype), self._load_bias, parts)
        else:
            layer.register_parameter("bias", None)

    @staticmethod
    def _no_expert(expert: int | None) -> None:
        if expert is not None:
            raise ValueError(f"this layer is not an expert stack; it has no expert {expert}")

    def _load_weight(self, layer, param, tensor, shard=None, expert=None) -> None:
        self._no_expert(expert)
        rows = shard_rows(layer.out_shards, shard)
        what = f"shard {shard!r} of the weight" if shard else "the weight"
        if not self.scheme.online:
            store_fp8(param[rows], tensor, what)
            return
        # (q, scale): rows already quantized (a tensor-parallel piece; fp8_tp_slice)
        q, scale = tensor if isinstance(tensor, tuple) else (None, None)
        if tuple((q if q is not None else tensor).shape) != tuple(param[rows].shape):
            raise ValueError(f"{what} expects shape {tuple(param[rows].shape)}, the checkpoint has "
                             f"{tuple((q if q is not None else tensor).shape)}")
        if q is None:
            q, scale = quantize_rows(tensor.to(param.device))
        with torch.no_grad():
            param[rows].copy_(q)
            layer.weight_scale[rows] = scale

    def _load_block_scale(self, layer, param, tensor, shard=None, expert=None) -> None:
        self._no_expert(expert)
        bn = self.scheme.block[0]
        rows = shard_rows(layer.out_shards, shard)
        if shard is not None:
            rows = slice(rows.start // bn, -(-rows.stop // bn))
        copy_checked(param[rows], tensor.float(), f"the {self.scheme.scale_name} of shard {shard!r}" if shard else
                     f"the {self.scheme.scale_name}")

    def _load_row_scale(self, layer, param, tensor, shard=None, expert=None) -> None:
        self._no_expert(expert)
        with torch.no_grad():
            fill_row_scale(param[shard_rows(layer.out_shards, shard)], tensor,
                           f"the weight_scale of shard {shard!r}" if shard else "the weight_scale")

    def _load_input_scale(self, layer, param, tensor, shard=None, expert=None) -> None:
        self._no_expert(expert)
        names = [n for n in layer.out_shards if n]
        i = names.index(shard) if shard in names else 0
        if shard is None and len(names) > 1:
            raise ValueError("a fused layer takes one input_scale per shard")
        if tensor.numel() != 1:
            raise ValueError(f"input_scale expects one number, the checkpoint has shape {tuple(tensor.shape)}")
        with torch.no_grad():
            param[i] = tensor.float().reshape(())

    def _load_bias(self, layer, param, tensor, shard=None, expert=None) -> None:
        self._no_expert(expert)
        copy_checked(param[shard_rows(layer.out_shards, shard)], tensor, f"shard {shard!r} of the bias" if shard
                     else "the bias")

    _TP_KINDS = {"weight": "weight", "weight_scale": "rows", "input_scale": "input", "bias": "bias"}

    def tp_slice(self, layer, name, tensor, shard, cut):
        kind = "block" if self.scheme.block is not None and name == self.scheme.scale_param and \
            not self.scheme.online else self._TP_KINDS[name]
        return fp8_tp_slice(self.scheme, kind, tensor, cut, f"{name} of shard {shard!r}" if shard else name)

    def scale(self, layer: nn.Module) -> torch.Tensor:
        return getattr(layer, self.scheme.scale_param)

    def dense_weight(self, layer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight (tests, and folding into a dense neighbour)."""
        from lamina.kernels.fp8 import dequantize

        block = None if self.scheme.online else self.scheme.block
        return dequantize(layer.weight, self.scale(layer), block, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        input_scale = layer.input_scale.max() if s.static_input else None
        block = None if s.online else s.block
        return fp8_linear(x, layer.weight, self.scale(layer), block, layer.bias, input_scale)
