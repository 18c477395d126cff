"""GPTQ (Frantar et al., 2022) for one linear weight, and the GPTQ v1 checkpoint tensors it is stored as.

Offline tooling (scripts/gptq_quantize.py drives it over a model); nothing at serving time imports it.

Given W [N, K] and the Hessian of the layer's squared output error, H = X^T X / n over calibration inputs X
[n, K], the columns are quantized one at a time and each column's rounding error is pushed onto the
columns not yet quantized, weighted by the inverse Hessian (the optimal least-squares correction, computed
from the upper Cholesky factor U of H^-1: err_j = (w_j - q_j) / U[j, j], w_{j+1:} -= err_j * U[j, j+1:]).
Columns go in blocks of `block`; inside a block the update is immediate, the rest of the matrix gets the
block's errors in one matmul. Groups of `group` consecutive columns (in quantization order) share a scale
and zero point, fitted (min-max) to the group's columns as they are when the group starts, i.e. after the
earlier columns' corrections. act_order quantizes columns by decreasing Hessian diagonal (the most
activated inputs first, while there is the most freedom left to absorb errors); the checkpoint then keeps
the original column order and records each column's group in g_idx.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class GptqResult:
    """One quantized weight, columns in the original order: W ~= scales[:, g_idx] * (q - zeros[:, g_idx])."""

    q: torch.Tensor  # int32 [N, K], 0 .. 2^bits - 1
    zeros: torch.Tensor  # int32 [N, G]
    scales: torch.Tensor  # fp16 [N, G]
    g_idx: torch.Tensor  # int32 [K]

    def dequantize(self) -> torch.Tensor:
        gi = self.g_idx.long()
        return self.scales.float()[:, gi] * (self.q.float() - self.zeros.float()[:, gi])

    def rows(self, sl: slice) -> GptqResult:
        """The rows `sl` (output channels) of this weight: its part of a fused quantization."""
        return GptqResult(self.q[sl].clone(), self.zeros[sl].clone(), self.scales[sl].clone(), self.g_idx.clone())


FIT_SHRINK = (0.80, 1.10, 21)  # --mse: scale factors tried around the min-max scale (linspace arguments)


def _group_params(w: torch.Tensor, maxq: int, sym: bool, min_zero: int, mse: bool = False,
                  weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (scale, zero) of a column group w [N, g], min-max over the range widened to include 0. The
    scale is rounded to fp16 here (the checkpoint's dtype), so the error feedback sees the stored weight.
    min_zero 1: GPTQ v1 stores zero - 1 in 4 bits, so a zero of 0 cannot be written; such rows (every value
    >= 0) get one more step of scale instead.

    mse: also try scales from FIT_SHRINK times the min-max one, each with the min-max zero point and its
    neighbours (a shifted grid: weights that already sit on another 4-bit grid, e.g. a GGUF Q4_1 model's,
    fit an integer-zero grid badly at min-max), and keep per row the candidate with the least squared
    rounding error over the group, weighted per column by `weight` [g] (e.g. the Hessian's diagonal); the
    min-max candidate is among them, so the fit is never worse by that measure."""
    xmin = w.min(dim=1).values.clamp(max=0)
    xmax = w.max(dim=1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    flat = xmin == xmax
    xmin, xmax = torch.where(flat, -1.0, xmin), torch.where(flat, 1.0, xmax)
    if sym:
        scale = (xmax - xmin) / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = (xmax - xmin) / maxq
        zero = torch.round(-xmin / scale)
        low = zero < min_zero
        scale = torch.where(low, (xmax - xmin) / (maxq - min_zero), scale)
        zero = torch.where(low, torch.full_like(zero, min_zero), zero)
    scale = scale.half().double().clamp_min(1e-8)
    if not mse:
        return scale, zero
    f = torch.linspace(*FIT_SHRINK, dtype=torch.float64, device=w.device)[:, None]
    s = (f * (xmax - xmin) / maxq).half().double().clamp_min(1e-8)  # [C, N]
    z0 = zero if sym else torch.round(-xmin / ((xmax - xmin) / maxq))
    shifts = (0,) if sym else (-1, 0, 1)
    cand_s = torch.cat([scale[None]] + [s] * len(shifts))
    cand_z = torch.cat([zero[None]] + [(z0 + d).clamp(min_zero, maxq).expand_as(s) for d in shifts])
    # The search in fp32 (it only ranks candidates; the chosen scale and zero are exact either way).
    wf, sf, zf = w.float()[None], cand_s.float()[..., None], cand_z.float()[..., None]
    err = ((torch.clamp(torch.round(wf / sf) + zf, 0, maxq) - zf) * sf - wf).square_()
    if weight is not None:
        err = err * weight.float()
    best = err.sum(-1).argmin(0, keepdim=True)  # [1, N]: ties keep the earliest, the min-max candidate first
    return cand_s.gather(0, best)[0], cand_z.gather(0, best)[0]


def inverse_hessian_factor(h: torch.Tensor, perm: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor U of (H[perm][:, perm] + damp * mean(diag H) * I)^-1, in fp64 on h's device."""
    h = h[perm][:, perm]
    h = h + damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def error_feedback(w: torch.Tensor, u: torch.Tensor, block: int,
                   round_column: Callable[[int, torch.Tensor, int], torch.Tensor]) -> None:
    """GPTQ's column loop over w [N, K] (fp64, columns already in quantization order), in place.

    round_column(col, w_block, j) gets column `col` as w_block[:, j] (w_block: the current block, later
    columns of it already corrected; a quantizer may read ahead in it, e.g. to fit a group) and returns that
    column's stored (dequantized) value; its error is then pushed onto the columns not yet quantized."""
    k = w.shape[1]
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        err = torch.zeros_like(w1)
        for j in range(i2 - i1):
            col = i1 + j
            e = (w1[:, j] - round_column(col, w1, j)) / u[col, col]
            w1[:, j:] -= e[:, None] * u[col, col:i2][None, :]
            err[:, j] = e
        w[:, i2:] -= err @ u[i1:i2, i2:]


def prepare_columns(w: torch.Tensor, h: torch.Tensor,
                    act_order: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w fp64 with dead inputs zeroed, h fp64 with dead diagonal set to 1, column order), on w's device."""
    w = w.detach().double().clone()
    h = h.detach().to(device=w.device, dtype=torch.float64).clone()
    dead = torch.diag(h) == 0  # inputs that were always 0: any weight is exact, so quantize 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    k = w.shape[1]
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k, device=w.device)
    return w, h, perm


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int = 4, group: int = 128, act_order: bool = False,
                  sym: bool = False, damp: float = 0.01, block: int = 128, min_zero: int = 1,
                  mse: bool = False) -> GptqResult:
    """w [N, K] (any float dtype), h [K, K] = X^T X / n -> the GPTQ quantization of w (computed in fp64 on
    w's device; the result is on the CPU). mse: fit each group's scale and zero by _group_params' search,
    weighting its columns by the Hessian's diagonal (their share of the output error)."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"group size {group} does not divide the {k} input columns")
    maxq = 2 ** bits - 1
    w, h, perm = prepare_columns(w, h, act_order)
    w = w[:, perm]
    hdiag = torch.diag(h)[perm]
    u = inverse_hessian_factor(h, perm, damp)
    block = max(group, block // group * group)  # groups never straddle blocks
    dev = w.device
    q = torch.zeros(n, k, dtype=torch.int32, device=dev)
    scales = torch.zeros(n, k // group, dtype=torch.float64, device=dev)
    zeros = torch.zeros(n, k // group, dtype=torch.float64, device=dev)

    def round_column(col: int, w1: torch.Tensor, j: int) -> torch.Tensor:
        if col % group == 0:
            s, z = _group_params(w1[:, j:j + group], maxq, sym, min_zero, mse, hdiag[col:col + group])
            scales[:, col // group], zeros[:, col // group] = s, z
        s, z = scales[:, col // group], zeros[:, col // group]
        qc = torch.clamp(torch.round(w1[:, j] / s) + z, 0, maxq)
        q[:, col] = qc.to(torch.int32)
        return (qc - z) * s

    error_feedback(w, u, block, round_column)
    inv = torch.argsort(perm).cpu()
    g_idx = (torch.arange(k) // group)[inv]  # stored column c was quantized at position inv[c]
    return GptqResult(q.cpu()[:, inv].contiguous(), zeros.cpu().to(torch.int32), scales.cpu().half(),
                      g_idx.to(torch.int32))


def rtn_quantize(w: torch.Tensor, bits: int = 4, group: int = 128, sym: bool = False,
                 mse: bool = False) -> GptqResult:
    """Round-to-nearest with the same groups and parameters (the baseline GPTQ improves on); mse: the fitted
    scales and zeros of _group_params' search (unweighted)."""
    n, k = w.shape
    maxq = 2 ** bits - 1
    wg = w.detach().double().cpu().reshape(n, k // group, group)
    params = [_group_params(wg[:, g], maxq, sym, 1, mse) for g in range(k // group)]
    s = torch.stack([p[0] for p in params], 1)
    z = torch.stack([p[1] for p in params], 1)
    q = torch.clamp(torch.round(wg / s[..., None]) + z[..., None], 0, maxq).reshape(n, k)
    return GptqResult(q.to(torch.int32), z.to(torch.int32), s.half(), (torch.arange(k) // group).to(torch.int32))


def _pack8(vals: torch.Tensor, dim: int) -> torch.Tensor:
    """int values 0..15 -> int32 with eight of them per element along `dim` (value j in bits 4j..4j+3)."""
    v = vals.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8) & 0xF
    packed = (v << (4 * torch.arange(8))).sum(-1)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def gptq_v1_tensors(r: GptqResult) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one Linear in the GPTQ v1 layout (`checkpoint_format: gptq`): qweight
    [K/8, N], qzeros [G, N/8] holding zero - 1, scales [G, N] fp16, g_idx [K]."""
    if int(r.zeros.min()) < 1:
        raise ValueError("GPTQ v1 cannot store a zero point of 0 (quantize with min_zero=1)")
    return {"qweight": _pack8(r.q.t(), 0), "qzeros": _pack8((r.zeros - 1).t(), 1),
            "scales": r.scales.t().contiguous(), "g_idx": r.g_idx.contiguous()}
