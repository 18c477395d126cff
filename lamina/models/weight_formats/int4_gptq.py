"""GPTQ and AWQ 4-bit checkpoints (the formats AutoGPTQ / GPTQModel and AutoAWQ write), repacked at load
into the grouped-integer layout (int4_native.py).

GPTQ (`quant_method: gptq`), per Linear: `qweight` int32 [K/8, N] (eight 4-bit values along K per int32,
value j in bits 4j..), `qzeros` int32 [K/G, N/8] (along N), `scales` fp16 [K/G, N], `g_idx` int32 [K]
(the group of each input column; act-order checkpoints permute it). W[n, k] = scales[g, n] * (q[k, n] -
z[g, n]) with g = g_idx[k]; the original "gptq" checkpoint format stores z - 1 (`checkpoint_format:
gptq`, the default), "gptq_v2" stores z itself. sym: z is 8 everywhere.

AWQ (`quant_method: awq`, GEMM version): `qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8], both
packed along N in AWQ's interleaved order (int32 nibble j holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][j]),
`scales` fp16 [K/G, N]; W[n, k] = scales[k // G, n] * (q[k, n] - z[k // G, n]).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lamina.models.weight_formats.int4_native import NativeInt4Format, NativeTensor, group_perm, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ int32 holds column AWQ_ORDER[j] of its eight


class GPTQFormat(NativeInt4Format):
    def __init__(self, bits: int, group: int, zero_plus_one: bool = True, desc_act: bool = False) -> None:
        super().__init__(bits, group)
        self.zero_plus_one = zero_plus_one  # "gptq" (v1) checkpoints store z - 1
        self.tp_splits_inputs = not desc_act  # act order: groups are not contiguous in K

    def native_tensors(self, in_features: int) -> tuple[NativeTensor, ...]:
        g, G = in_features // self.group, self.group
        return (NativeTensor("qweight", lambda k, n: (k // 8, n), torch.int32, 1, in_dim=0, in_unit=8),
                NativeTensor("qzeros", lambda k, n: (g, n // 8), torch.int32, 1, pack=8, in_dim=0, in_unit=G),
                NativeTensor("scales", lambda k, n: (g, n), torch.float16, 1, in_dim=0, in_unit=G),
                NativeTensor("g_idx", lambda k, n: (k,), torch.int32, None, in_dim=0))

    def to_layout(self, layer: nn.Module):
        g_idx = self.shard_g_idx(layer, layer.g_idx, "g_idx")
        return gptq_layout(layer.qweight, layer.qzeros, layer.scales, g_idx, self.group, self.zero_plus_one)


def gptq_layout(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                group: int, zero_plus_one: bool):
    """One GPTQ weight -> (q [N, K] in the stored column order, scales, offsets [N, K/G], perm or None)."""
    q = unpack_int32(qweight, 0).t()  # [N, K]
    z = unpack_int32(qzeros, 1).t().float() + (1 if zero_plus_one else 0)  # [N, K/G]
    s = scales.t().float()
    perm = group_perm(g_idx, group, "g_idx")
    if perm is not None:
        q = q[:, perm]
    return q, s, -z * s, perm


class AWQFormat(NativeInt4Format):
    def native_tensors(self, in_features: int) -> tuple[NativeTensor, ...]:
        g, G = in_features // self.group, self.group
        return (NativeTensor("qweight", lambda k, n: (k, n // 8), torch.int32, 1, pack=8, in_dim=0),
                NativeTensor("qzeros", lambda k, n: (g, n // 8), torch.int32, 1, pack=8, in_dim=0, in_unit=G),
                NativeTensor("scales", lambda k, n: (g, n), torch.float16, 1, in_dim=0, in_unit=G))

    @staticmethod
    def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
        """[R, N/8] AWQ-packed -> [R, N] in column order."""
        vals = unpack_int32(packed, 1).reshape(packed.shape[0], -1, 8)  # nibble order
        inverse = [AWQ_ORDER.index(i) for i in range(8)]
        return vals[..., inverse].reshape(packed.shape[0], -1)

    def to_layout(self, layer: nn.Module):
        q = self._unpack_awq(layer.qweight).t()  # [N, K]
        z = self._unpack_awq(layer.qzeros).t().float()
        s = layer.scales.t().float()
        return q, s, -z * s, None


def _quantized_linear(name: str, module: nn.Module, skip_lm_head: bool) -> bool:
    """Which layers a GPTQ/AWQ checkpoint quantizes: every Linear in the decoder layers except MoE routers
    (their gate is tiny and kept dense), plus lm_head when the config says so."""
    from lamina.models.layers.linear import Linear

    if not isinstance(module, Linear):
        return False
    if name == "lm_head":
        return not skip_lm_head
    return name.startswith("model.layers.") and not name.endswith((".gate", "shared_expert_gate"))


def choose_gptq(quant_config: dict[str, Any], model_config: Any):
    """The FormatChoice for `quant_method: gptq` (quantization.CHOOSERS)."""
    bits, group = int(quant_config.get("bits", 4)), int(quant_config.get("group_size", 128))
    fmt = str(quant_config.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"unsupported GPTQ checkpoint_format {fmt!r}; supported: gptq, gptq_v2")
    if group == -1:
        raise ValueError("unsupported GPTQ group_size -1 (one group per row); supported: 32, 64, 128, ...")
    GPTQFormat(bits, group)  # refuses an unsupported bit width / group size now, before anything loads
    skip_head = not quant_config.get("lm_head", False)
    desc_act = bool(quant_config.get("desc_act", False))

    def choose(name: str, module: nn.Module):
        from lamina.models.layers.moe import FusedExperts
        from lamina.models.weight_formats.int4_experts import GPTQExperts

        if isinstance(module, FusedExperts):
            return GPTQExperts(bits, group, fmt == "gptq")
        return GPTQFormat(bits, group, fmt == "gptq", desc_act) if _quantized_linear(name, module, skip_head) \
            else None

    return choose


def choose_awq(quant_config: dict[str, Any], model_config: Any):
    """The FormatChoice for `quant_method: awq` (GEMM version; quantization.CHOOSERS)."""
    bits = int(quant_config.get("bits", quant_config.get("w_bit", 4)))
    group = int(quant_config.get("group_size", quant_config.get("q_group_size", 128)))
    version = str(quant_config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"unsupported AWQ version {version!r}; supported: gemm")
    if not quant_config.get("zero_point", True):
        raise ValueError("unsupported AWQ without zero points; supported: zero_point true")
    AWQFormat(bits, group)
    return lambda name, module: AWQFormat(bits, group) if _quantized_linear(name, module, True) else None
