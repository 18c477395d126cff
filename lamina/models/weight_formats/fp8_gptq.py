"""Error-compensating FP8 (e4m3) quantization of one linear weight: GPTQ's column-by-column error feedback
(gptq_solver.error_feedback) with e4m3 rounding instead of a 4-bit grid.

Offline tooling (scripts/gptq_quantize.py --format fp8); nothing at serving time imports it.

Why: e4m3 keeps 3 mantissa bits, so round-to-nearest leaves every weight with an error of up to 2^-4 of
itself whatever the scales. Those errors are independent, and on correlated inputs they add up in the
layer's output; pushing each column's error onto the columns not yet rounded (weighted by the inverse
Hessian of the calibration inputs) makes later columns cancel it, as GPTQ does for int4. The grid is fixed
by one scale per output row (the row's amax maps to 448, taken from the weight before any correction; a
corrected weight beyond it saturates at 448), so the result is a standard row-scaled FP8 weight
(compressed-tensors strategy "channel", lamina's Fp8Linear row scales). No groups, so act_order only
changes the order of the feedback: the stored weight keeps the original column order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.kernels.fp8 import FP8, FP8_MAX, to_fp8
from lamina.models.weight_formats.gptq_solver import error_feedback, inverse_hessian_factor, prepare_columns

_TINY = 1e-12  # an all-zero row gets this scale (as kernels.fp8.quantize_rows)


@dataclass
class Fp8Weight:
    """One row-scaled FP8 weight: w ~= q.float() * scale[:, None]."""

    q: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # fp32 [N]

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    def rows(self, sl: slice) -> Fp8Weight:
        return Fp8Weight(self.q[sl].clone(), self.scale[sl].clone())


def fp8_row_scales(w: torch.Tensor) -> torch.Tensor:
    """One fp32 scale per output row of w [N, K]: amax / 448 (quantize_rows' scales)."""
    return (w.float().abs().amax(dim=1) / FP8_MAX).clamp_min(_TINY)


def fp8_gptq_quantize(w: torch.Tensor, h: torch.Tensor, act_order: bool = True, damp: float = 0.01,
                      block: int = 128) -> Fp8Weight:
    """w [N, K], h [K, K] = X^T X / n -> its FP8 weight, chosen to lower the output error ||X (w - q * s)^T||
    below round-to-nearest's (same scales s). Computed in fp64 on w's device; the result is on the CPU."""
    scale = fp8_row_scales(w).to(w.device)
    w, h, perm = prepare_columns(w, h, act_order)
    w = w[:, perm]
    u = inverse_hessian_factor(h, perm, damp)
    s64 = scale.double()
    q = torch.empty(w.shape, dtype=FP8, device=w.device)

    def round_column(col: int, w1: torch.Tensor, j: int) -> torch.Tensor:
        qc = to_fp8(w1[:, j].float() / scale)  # fp32 division, as round-to-nearest (equal under H = I)
        q[:, col] = qc
        return qc.double() * s64

    error_feedback(w, u, block, round_column)
    inv = torch.argsort(perm)
    return Fp8Weight(q[:, inv].contiguous().cpu(), scale.cpu())


def fp8_rtn_quantize(w: torch.Tensor) -> Fp8Weight:
    """Round-to-nearest with the same scales (what online --quantization fp8 stores; the baseline)."""
    scale = fp8_row_scales(w)
    return Fp8Weight(to_fp8(w.float() / scale[:, None]).cpu(), scale.cpu())
