"""FP8 (e4m3) MoE expert stacks: gate_up_proj [E, 2I, H] and down_proj [E, H, I] in float8_e4m3fn, each with
its scales, in the same schemes as fp8.py's Linear format:
- block scales: `gate_up_proj_weight_scale_inv` [E, ceil(2I/bn), ceil(H/bk)] (I a multiple of bn, so gate
  and up keep their own scale rows) and `down_proj_weight_scale_inv` [E, ceil(H/bn), ceil(I/bk)];
- row / per-tensor scales: `gate_up_proj_weight_scale` [E, 2I] and `down_proj_weight_scale` [E, H];
- online: the same row scales as buffers, computed while the dense checkpoint loads;
- static activation scales are accepted (`*_input_scale`) but unused: the experts run weight-only.
Checkpoint names map here through families/common.py (experts.N.gate_proj.weight_scale_inv ->
experts.gate_up_proj_weight_scale_inv, expert N, shard "gate").

The matmul is kernels.fp8.fp8_fused_moe: on CUDA FP8-reading GEMVs for decode and FP8-reading grouped
GEMMs for more pairs (triton_fp8_moe_gemm.py); on the CPU the stacks are dequantized for
kernels.moe.fused_moe (the reference).
"""
from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.fp8 import FP8, dequantize, fp8_fused_moe, quantize_rows
from lamina.models.weight_formats.base import ExpertFormat, copy_checked, new_param, register_param
from lamina.models.weight_formats.fp8 import Fp8Scheme, fill_row_scale, fp8_tp_slice, store_fp8

_PROJ = ("gate_up_proj", "down_proj")


class Fp8Experts(ExpertFormat):
    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def __repr__(self) -> str:
        return f"Fp8Experts({self.scheme})"

    def _scale_name(self, proj: str) -> str:
        return f"{proj}_{self.scheme.scale_param}"

    def create_params(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                      dtype: torch.dtype) -> None:
        s, e = self.scheme, num_experts
        shapes = {"gate_up_proj": (2 * intermediate, hidden), "down_proj": (hidden, intermediate)}
        parts = {"gate_up_proj": tuple(f"{i}.{h}" for i in range(e) for h in ("gate", "up")),
                 "down_proj": tuple(str(i) for i in range(e))}
        if s.block is not None and not s.online and intermediate % s.block[0]:
            raise ValueError(f"FP8 block size {s.block[0]} does not divide the experts' intermediate size "
                             f"{intermediate}")
        for proj, (n, k) in shapes.items():
            register_param(layer, proj, new_param((e, n, k), FP8), self._loader(proj, "weight"), parts[proj])
            if s.online:
                layer.register_buffer(self._scale_name(proj), torch.ones(e, n, dtype=torch.float32))
            elif s.block is not None:
                bn, bk = s.block
                register_param(layer, self._scale_name(proj), new_param((e, -(-n // bn), -(-k // bk)),
                               torch.float32), self._loader(proj, "block"), parts[proj])
            else:
                register_param(layer, self._scale_name(proj), new_param((e, n), torch.float32),
                               self._loader(proj, "rows"), parts[proj])
            if s.static_input:
                width = 2 if proj == "gate_up_proj" else 1
                register_param(layer, f"{proj}_input_scale", new_param((e, width), torch.float32),
                               self._loader(proj, "input"), parts[proj])

    def _loader(self, proj: str, kind: str):
        def load(layer, param, tensor, shard=None, expert=None) -> None:
            self._load(layer, proj, kind, param, tensor, shard, expert)

        return load

    def _load(self, layer, proj, kind, param, tensor, shard, expert) -> None:
        if expert is None:
            if shard is not None:
                raise ValueError(f"shard {shard!r} of the stacked experts needs an expert index")
            for i in range(layer.num_experts):  # a stacked tensor: one expert at a time
                self._load(layer, proj, kind, param, tensor[i], None, i)
            return
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} is out of range (the config has {layer.num_experts})")
        if proj == "down_proj" and shard is not None:
            raise ValueError(f"the down projection has no shard {shard!r}")
        if shard not in (None, "gate", "up"):
            raise ValueError(f"expert {expert} has no shard {shard!r} (its shards: gate, up)")
        rows, i = slice(None), layer.intermediate
        if shard is not None:
            rows = slice(0, i) if shard == "gate" else slice(i, 2 * i)
        what = f"expert {expert}'s {shard or proj} {kind}"
        target = param[expert]
        with torch.no_grad():
            if kind == "weight" and self.scheme.online:
                # (q, scale): rows already quantized (a tensor-parallel piece; fp8_tp_slice)
                q, scale = tensor if isinstance(tensor, tuple) else (None, None)
                shape = tuple((q if q is not None else tensor).shape)
                if shape != tuple(target[rows].shape):
                    raise ValueError(f"{what} expects shape {tuple(target[rows].shape)}, the checkpoint has "
                                     f"{shape}")
                if q is None:
                    q, scale = quantize_rows(tensor.to(param.device))
                target[rows].copy_(q)
                getattr(layer, self._scale_name(proj))[expert, rows] = scale
            elif kind == "weight":
                store_fp8(target[rows], tensor, what)
            elif kind == "block":
                bn = self.scheme.block[0]
                if shard is not None:
                    rows = slice(rows.start // bn, rows.stop // bn)
                copy_checked(target[rows], tensor.float(), what)
            elif kind == "rows":
                fill_row_scale(target[rows], tensor, what)
            else:  # input scale: kept for completeness, unused (weight-only experts)
                if tensor.numel() != 1:
                    raise ValueError(f"{what} expects one number, the checkpoint has shape {tuple(tensor.shape)}")
                target[int(shard == "up")] = tensor.float().reshape(())

    def tp_slice(self, layer, name, tensor, shard, cut):
        if name in _PROJ:
            kind = "weight"
        elif name.endswith("_input_scale"):
            kind = "input"
        else:
            kind = "block" if self.scheme.block is not None and not self.scheme.online else "rows"
        return fp8_tp_slice(self.scheme, kind, tensor, cut, f"{name} ({shard or 'whole'})")

    def dense_stacks(self, layer: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        block = None if self.scheme.online else self.scheme.block
        return tuple(dequantize(getattr(layer, p), getattr(layer, self._scale_name(p)), block, dtype)
                     for p in _PROJ)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        block = None if self.scheme.online else self.scheme.block
        s13, s2 = (getattr(layer, self._scale_name(p)) for p in _PROJ)
        return fp8_fused_moe(x, layer.gate_up_proj, s13, layer.down_proj, s2, block, topk_weights, topk_ids)
