"""The grouped-integer weight format: a Linear's weight kept as 4- or 8-bit integers with a scale and an
offset per group of input columns (the layout of kernels/wq_matmul.py), applied without a dense copy on
the GPU (Triton, dequantizing in registers) and, for 4 bits, on the CPU (torch's packed int4 matmul).

Subclasses say how a checkpoint's tensors become that layout (GGUF blocks, GPTQ, AWQ, compressed-tensors):
`convert(layer, shard, tensor)` for formats whose checkpoint holds one tensor per weight (it arrives as the
layer's `weight`), or their own parameters plus `finish_loading` for formats whose checkpoint splits a
weight over several tensors (qweight / qzeros / scales / g_idx).

Storage on the layer: `weight` (the integers: uint8 [N, K/2] for 4 bits, int8 [N, K] for 8), buffers
`weight_scales` and `weight_offsets` (fp16 [N, K/group]), `bias` in the model dtype if the layer has one,
and after loading, on the CPU only, the prepared CPU form (`finish_loading`; not a parameter, not saved;
LAMINA_CPU_QUANT_FORMS=0 leaves it out: every call dequantizes, in fp32 for fp32 activations).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from lamina.kernels import wq_matmul
from lamina.kernels.wq_matmul import CpuInt4Pack, cpu_int4_ok, dequantize, dequantize_rows, kn_wanted, wq_linear
from lamina.models.weight_formats.base import WeightFormat, copy_checked, new_param, register_param

SCALE_DTYPE = torch.float16


def shard_rows(layer: nn.Module, shard: str | None) -> slice:
    """The output rows of fused part `shard` (None or "": all of them)."""
    if not shard:
        return slice(0, sum(layer.out_shards.values()))
    start = 0
    for name, size in layer.out_shards.items():
        if name == shard:
            return slice(start, start + size)
        start += size
    named = [n for n in layer.out_shards if n]
    raise ValueError(f"no shard {shard!r}" + (f" (its shards: {', '.join(named)})" if named else
                                                     " (it is not a fused projection)"))


class GroupQuantFormat(WeightFormat):
    """bits (4 | 8) and group (input columns per scale) for the whole layer."""

    def __init__(self, bits: int, group: int) -> None:
        if bits not in (4, 8):
            raise ValueError(f"unsupported weight bit width {bits}; supported: 4, 8")
        if group <= 0 or group % 8:
            raise ValueError(f"unsupported group size {group}; it must be a positive multiple of 8")
        self.bits, self.group = bits, group
        self.dtype = torch.float32

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bits={self.bits}, group={self.group})"

    # -- storage ----------------------------------------------------------------------------------------
    def create_params(self, layer: nn.Module, in_features: int, out_shards: Mapping[str, int], bias: bool,
                      dtype: torch.dtype) -> None:
        if in_features % self.group:
            raise ValueError(f"in_features {in_features} is not a multiple of the group size {self.group}")
        self.dtype = dtype
        n, k = sum(out_shards.values()), in_features
        parts = tuple(s for s in out_shards if s)
        qshape, qdtype = ((n, k // 2), torch.uint8) if self.bits == 4 else ((n, k), torch.int8)
        register_param(layer, "weight", new_param(qshape, qdtype), self._load_weight, parts)
        layer.register_buffer("weight_scales", torch.empty(n, k // self.group, dtype=SCALE_DTYPE))
        layer.register_buffer("weight_offsets", torch.empty(n, k // self.group, dtype=SCALE_DTYPE))
        if bias:
            register_param(layer, "bias", new_param((n,), dtype), self._load_bias, parts)
        else:
            layer.register_parameter("bias", None)

    def convert(self, layer: nn.Module, shard: str, tensor: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        """One checkpoint tensor for `rows` output rows -> (qweight, scales, offsets) in this layout."""
        raise NotImplementedError(f"{type(self).__name__} loads its weight from several tensors")

    def _load_weight(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                     expert: int | None = None) -> None:
        if expert is not None:
            raise ValueError(f"this weight is not an expert stack (got expert {expert})")
        rows = shard_rows(layer, shard)
        what = f"shard {shard!r} of the weight" if shard else "the weight"
        if not shard and len(layer.out_shards) > 1:
            raise ValueError("a quantized fused projection loads one part at a time")
        q, s, o = self.convert(layer, shard or "", tensor, rows.stop - rows.start)
        self.store(layer, rows, q, s, o, what)

    def store(self, layer: nn.Module, rows: slice, q: torch.Tensor, s: torch.Tensor, o: torch.Tensor,
              what: str) -> None:
        """Writes converted rows into the layer's storage, refusing wrong shapes (scales included)."""
        copy_checked(layer.weight[rows], q, what)
        copy_checked(layer.weight_scales[rows], s, f"the scales of {what}")
        copy_checked(layer.weight_offsets[rows], o, f"the offsets of {what}")

    def _load_bias(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                   expert: int | None = None) -> None:
        if expert is not None:
            raise ValueError(f"this bias is not an expert stack (got expert {expert})")
        copy_checked(param[shard_rows(layer, shard)], tensor, f"shard {shard!r} of the bias" if shard else "the bias")

    # -- after loading ----------------------------------------------------------------------------------
    def finish_loading(self, layer: nn.Module) -> None:
        """Prepares the CPU form: torch's packed int4 for 4 bits; for 8 bits (no grouped int8 CPU kernel
        in torch) two int4 packs (CpuInt8Split), else a bf16 copy (half fp32's bytes)."""
        layer.__dict__.pop("_cpu_pack", None)
        layer.__dict__.pop("_cpu_dense", None)
        layer.__dict__.pop("_kn", None)
        from lamina.models.layers.linear import Embedding

        if layer.weight.is_meta or isinstance(layer, Embedding):
            return  # an embedding reads rows only (a tied lm_head is a Linear with its own CPU form)
        if layer.weight.is_cuda:
            if kn_wanted(layer.weight, layer.weight_scales, self.bits):
                # the decode GEMV's repacked copy (+0.5 byte per weight: see triton_wq_gemv_kn.py)
                from lamina.kernels.triton_wq_gemv_kn import KnWeight

                layer.__dict__["_kn"] = KnWeight.build(layer.weight, layer.weight_scales, layer.weight_offsets)
            return
        if os.environ.get("LAMINA_CPU_QUANT_FORMS", "1") == "0":
            return  # the fp32 reference (dequantize per call): tests that need fp32 compute, not bf16's
        if cpu_int4_ok(layer.weight, layer.weight_scales, self.bits):
            pack = CpuInt4Pack if self.bits == 4 else wq_matmul.CpuInt8Split
            layer.__dict__["_cpu_pack"] = pack.build(layer.weight, layer.weight_scales, layer.weight_offsets)
        else:
            layer.__dict__["_cpu_dense"] = self.dequantized(layer, torch.bfloat16)

    def dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The dense [N, K] weight (tests and the dense reference)."""
        return dequantize(layer.weight, layer.weight_scales, layer.weight_offsets, self.bits, dtype)

    # -- compute ----------------------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        d = layer.__dict__
        return wq_linear(x, layer.weight, layer.weight_scales, layer.weight_offsets, self.bits, layer.bias,
                         cpu_pack=d.get("_cpu_pack"), cpu_dense=d.get("_cpu_dense"), kn=d.get("_kn"))

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(layer.weight, layer.weight_scales, layer.weight_offsets, self.bits, ids, self.dtype)

    def tie(self, layer: nn.Module, source: nn.Module) -> None:
        f = getattr(source, "format", None)
        if not isinstance(f, GroupQuantFormat) or (f.bits, f.group) != (self.bits, self.group) or \
                layer.bias is not None or tuple(source.weight.shape) != tuple(layer.weight.shape):
            raise ValueError(f"cannot tie {self!r} {tuple(layer.weight.shape)} to {f!r}")
        layer.weight = source.weight
        layer.weight_scales = source.weight_scales
        layer.weight_offsets = source.weight_offsets
