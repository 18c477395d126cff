"""GPTQ MoE expert stacks: each expert's gate, up and down projections as GPTQ tensors (experts.N.gate_proj
.qweight / qzeros / scales / g_idx; families/common.py maps them to gate_up_proj_qweight etc., expert N,
shard "gate" | "up"), repacked after loading into stacked grouped-integer layouts:
gate_up [E, 2I, H/2] and down [E, H, I/2] (uint8), their scales/offsets [E, rows, K/G], and per-expert
act-order permutations.

On CUDA the matmul is the grouped MoE GEMM that dequantizes in registers (kernels/triton_wq_moe.py: decode,
prefill and CUDA-graph capture alike, no host syncs); elsewhere it runs expert by expert over the tokens
routed to it (kernels/wq_matmul.wq_linear: the reference).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lamina.kernels.dispatch import use_triton
from lamina.kernels.wq_matmul import wq_linear
from lamina.models.weight_formats.base import ExpertFormat, clear_params, copy_checked, new_param, register_param
from lamina.models.weight_formats.int4_gptq import gptq_layout
from lamina.models.weight_formats.int4_groups import SCALE_DTYPE
from lamina.models.weight_formats.int4_native import check_bits_group, pack_layout

_PROJ = ("gate_up_proj", "down_proj")


class GPTQExperts(ExpertFormat):
    def __init__(self, bits: int, group: int, zero_plus_one: bool = True) -> None:
        check_bits_group(bits, group)
        self.bits, self.group, self.zero_plus_one = bits, group, zero_plus_one

    def __repr__(self) -> str:
        return f"GPTQExperts(bits={self.bits}, group={self.group})"

    def create_params(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                      dtype: torch.dtype) -> None:
        e, g = num_experts, self.group
        for proj, (n, k), shards in (("gate_up_proj", (2 * intermediate, hidden), ("gate", "up")),
                                     ("down_proj", (hidden, intermediate), ())):
            check_bits_group(self.bits, g, k)
            parts = tuple(f"{i}.{s}" if s else str(i) for i in range(e) for s in (shards or ("",)))
            shapes = {"qweight": ((e, k // 8, n), torch.int32), "qzeros": ((e, k // g, n // 8), torch.int32),
                      "scales": ((e, k // g, n), torch.float16),
                      "g_idx": ((e, max(len(shards), 1), k), torch.int32)}
            for name, (shape, dt) in shapes.items():
                register_param(layer, f"{proj}_{name}", new_param(shape, dt), self._loader(proj, name), parts)

    def _loader(self, proj: str, name: str):
        def load(layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: str | None = None,
                 expert: int | None = None) -> None:
            if expert is None or not 0 <= expert < layer.num_experts:
                raise ValueError(f"{proj}_{name} loads one expert at a time (got expert {expert})")
            if proj == "down_proj" and shard is not None:
                raise ValueError(f"the down projection has no shard {shard!r}")
            if proj == "gate_up_proj" and shard not in ("gate", "up"):
                raise ValueError(f"expert {expert}'s gate|up needs shard gate or up (got {shard!r})")
            target = param[expert]
            what = f"expert {expert}'s {shard or 'down'} {name}"
            half = 0 if shard in (None, "gate") else 1
            if name == "g_idx":
                target = target[half]
            elif shard is not None:
                n = target.shape[-1] // 2
                target = target[..., half * n:(half + 1) * n]
            copy_checked(target, tensor, what)

        return load

    def tp_slice(self, layer, name, tensor, shard, cut):
        """One expert's GPTQ tensor ([K/8, N] qweight, [K/G, N/8] qzeros, [K/G, N] scales, [K] g_idx): gate/up
        cut along N, down along K in whole groups (an act-order down projection cannot be: refused)."""
        kind = name.rpartition("_")[2] if not name.endswith("g_idx") else "g_idx"
        what = f"{name} ({shard or 'down'})"
        if cut.dim == 0:
            return tensor if kind == "g_idx" else cut.along(tensor, 1, 8 if kind == "qzeros" else 1, what=what)
        unit = {"qweight": 8, "qzeros": self.group, "scales": self.group, "g_idx": 1}[kind]
        piece = cut.along(tensor, 0, unit, what=what)
        if kind == "g_idx":
            piece = piece - cut.start // self.group
            plain = torch.arange(piece.numel(), device=piece.device) // self.group
            if not torch.equal(piece.long(), plain):
                raise ValueError(f"{what}: an act-order (desc_act) expert down projection cannot be split over "
                                 "tensor-parallel ranks")
        return piece

    @torch.no_grad()
    def finish_loading(self, layer: nn.Module) -> None:
        stacks = {}
        for proj in _PROJ:
            qs, ss, os_, perms = [], [], [], []
            for i in range(layer.num_experts):
                g_idx = getattr(layer, f"{proj}_g_idx")[i]
                if any(not torch.equal(g_idx[0], g) for g in g_idx[1:]):
                    raise ValueError(f"expert {i}: gate and up have different group orders")
                q, s, o, perm = gptq_layout(getattr(layer, f"{proj}_qweight")[i], getattr(layer, f"{proj}_qzeros")[i],
                                            getattr(layer, f"{proj}_scales")[i], g_idx[0], self.group,
                                            self.zero_plus_one)
                qs.append(pack_layout(q))
                ss.append(s.to(SCALE_DTYPE))
                os_.append(o.to(SCALE_DTYPE))
                perms.append(perm)
            stacks[proj] = (torch.stack(qs), torch.stack(ss), torch.stack(os_), perms)
        clear_params(layer)
        for proj, (q, s, o, perms) in stacks.items():
            layer.register_parameter(proj, nn.Parameter(q, requires_grad=False))
            layer.register_buffer(f"{proj}_scales", s)
            layer.register_buffer(f"{proj}_offsets", o)
            layer.__dict__[f"_{proj}_perms"] = perms
            layer.__dict__[f"_{proj}_perm_stack"] = perm_stack(perms, q.shape[-1] * 2)

    def _linear(self, layer: nn.Module, proj: str, e: int, x: torch.Tensor) -> torch.Tensor:
        return wq_linear(x, getattr(layer, proj)[e], getattr(layer, f"{proj}_scales")[e],
                         getattr(layer, f"{proj}_offsets")[e], self.bits, perm=layer.__dict__[f"_{proj}_perms"][e])

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if use_triton(x) and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
            from lamina.kernels.triton_wq_moe import wq_moe_grouped

            stacks = [t for p in _PROJ for t in (getattr(layer, p), getattr(layer, f"{p}_scales"),
                                                 getattr(layer, f"{p}_offsets"), layer.__dict__[f"_{p}_perm_stack"])]
            return wq_moe_grouped(x, *stacks, self.bits, topk_weights, topk_ids)
        out = torch.zeros_like(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # No host-side routing counts inside a CUDA graph: every expert on every token, weighted by its
            # routing weight (0 where not chosen). Correct and replayable, E times the work.
            for e in range(layer.num_experts):
                w = (topk_weights * (topk_ids == e)).sum(-1, keepdim=True).to(x.dtype)
                gate, up = self._linear(layer, "gate_up_proj", e, x).chunk(2, dim=-1)
                out += w * self._linear(layer, "down_proj", e, F.silu(gate) * up)
            return out
        flat = topk_ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=layer.num_experts).tolist()
        tokens = order // topk_ids.shape[1]
        weights = topk_weights.flatten()[order].to(x.dtype)
        start = 0
        for e, c in enumerate(counts):
            if c:
                idx = tokens[start:start + c]
                h = self._linear(layer, "gate_up_proj", e, x[idx])
                gate, up = h.chunk(2, dim=-1)
                y = self._linear(layer, "down_proj", e, F.silu(gate) * up)
                out.index_add_(0, idx, y * weights[start:start + c, None])
            start += c
        return out


def perm_stack(perms: list[torch.Tensor | None], k: int) -> torch.Tensor | None:
    """The experts' act-order column orders as one int32 [E, K] (identity rows for experts without one), or
    None when no expert has one (the grouped kernel then reads the activations in order)."""
    if all(p is None for p in perms):
        return None
    dev = next(p for p in perms if p is not None).device
    ident = torch.arange(k, dtype=torch.int32, device=dev)
    return torch.stack([ident if p is None else p.to(torch.int32) for p in perms]).contiguous()
