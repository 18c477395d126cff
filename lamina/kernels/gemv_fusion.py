"""What the decode GEMV (triton_gemv.py) fuses: a Prologue applied to x before the products (RMSNorm, residual
add + RMSNorm, SiLU/GELU-and-mul) or an Epilogue applied to y before it is written (SiLU/GELU-and-mul of the
gate|up halves, residual add + RMSNorm of the whole output row). Plain descriptions; the kernel reads them."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Prologue:
    """What the GEMV does to x before multiplying (the small op that would otherwise be its own launch).

    kind "norm": x -> rms_norm(x) * (weight + offset); "add_norm": the same on x + residual, whose sum (rounded
    to x's dtype) is written to sum_out; "silu" / "gelu_tanh": x is [M, 2K] gate|up -> act(gate) * up,
    rounded once as triton_activation rounds it. The norm's 1/rms scales the fp32 accumulator instead of each
    normalized element: the inputs to the products are x * weight rounded once, where the separate norm rounds
    x * rstd * weight once (the same size of error; results are not bitwise those of the two launches)."""

    kind: str
    weight: torch.Tensor | None = None
    eps: float = 1e-6
    offset: float = 0.0
    residual: torch.Tensor | None = None
    sum_out: torch.Tensor | None = None

    @property
    def code(self) -> int:
        return {"norm": 1, "add_norm": 2, "silu": 3, "gelu_tanh": 4}[self.kind]


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What the GEMV does to y before writing it (the small op that would otherwise follow as its own launch).

    kind "silu" / "gelu_tanh": weight is gate|up, [2N, K]; y = act(x W_gate^T) * (x W_up^T), each half rounded
    to the output dtype first (so the values are the unfused GEMV's followed by silu_and_mul); split-K configs
    are not allowed. "add_norm": y is written as y + residual (rounded like fused_add_rms_norm's sum, the new
    residual stream) and norm_out gets rms_norm(y + residual) * (weight + offset) of each whole row, computed
    by the last program to finish (a workspace is required, new_workspace(..., epilogue="add_norm"))."""

    kind: str
    weight: torch.Tensor | None = None
    eps: float = 1e-6
    offset: float = 0.0
    residual: torch.Tensor | None = None
    norm_out: torch.Tensor | None = None

    @property
    def code(self) -> int:
        return {"silu": 1, "gelu_tanh": 2, "add_norm": 3}[self.kind]
