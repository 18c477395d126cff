"""Random Mamba-2 SSD batches for the kernel tests, and the oracle: the recurrence written out per token, with
nothing shared with lamina.kernels.mamba_ssd (its references are tested against this too)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Batch:
    x: torch.Tensor  # [T, H, P]
    dt: torch.Tensor  # [T, H] raw
    A_log: torch.Tensor  # [H]
    B: torch.Tensor  # [T, G, N]
    C: torch.Tensor  # [T, G, N]
    D: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
    query_start: list[int]
    slots: list[int]
    init: list[bool]
    pool: torch.Tensor  # [num_slots, H, P, N] fp32: live states where init, NaN elsewhere


def make_batch(lens: list[int], heads: int, head_dim: int, groups: int, dstate: int, dtype: torch.dtype, seed: int,
               init: list[bool] | None = None, extra_slots: int = 3) -> Batch:
    """Magnitudes as a trained Mamba-2 has them: A = -uniform(1, 16), softplus(dt_bias) in [1e-3, 0.1] (HF's
    init), raw dt around 0, so dt A reaches about -2 per token; states of the scale a running sequence holds."""
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lens), len(lens)
    init = [i % 2 == 1 for i in range(b)] if init is None else init
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = rnd(t, heads, head_dim).to(dtype)
    dt = (0.5 * rnd(t, heads)).to(dtype)
    a_log = torch.log(1 + 15 * torch.rand(heads, generator=gen))
    step = torch.exp(math.log(1e-3) + torch.rand(heads, generator=gen) * (math.log(0.1) - math.log(1e-3)))
    dt_bias = step + torch.log(-torch.expm1(-step))  # inverse softplus
    B = rnd(t, groups, dstate).to(dtype)
    C = rnd(t, groups, dstate).to(dtype)
    D = rnd(heads)
    qs = [0]
    for n in lens:
        qs.append(qs[-1] + n)
    n_slots = b + extra_slots
    slots = torch.randperm(n_slots, generator=gen)[:b].tolist()
    pool = torch.full((n_slots, heads, head_dim, dstate), float("nan"))
    for i, s in enumerate(slots):
        if init[i]:
            pool[s] = 0.5 * rnd(heads, head_dim, dstate)
    return Batch(x, dt, a_log, B, C, D, dt_bias, qs, slots, init, pool)


def oracle_seq(x, dt, A_log, B, C, D, dt_bias, s0, dt_min=0.0, dt_max=float("inf")):
    """One sequence token by token, head by head, in float64: x [L, H, P], B/C [L, G, N], s0 [H, P, N].
    Returns (y [L, H, P], the list of states after each token)."""
    heads, groups = x.shape[1], B.shape[1]
    s = s0.double().clone()
    ys, states = [], []
    for t in range(x.shape[0]):
        yt = torch.empty(heads, x.shape[2], dtype=torch.float64)
        for h in range(heads):
            g = h // (heads // groups)
            d = F.softplus(dt[t, h].double() + dt_bias[h].double()).clamp(dt_min, dt_max)
            a = -torch.exp(A_log[h].double())
            s[h] = torch.exp(d * a) * s[h] + d * torch.outer(x[t, h].double(), B[t, g].double())
            yt[h] = s[h] @ C[t, g].double() + D[h].double() * x[t, h].double()
        ys.append(yt)
        states.append(s.clone())
    y = torch.stack(ys) if ys else torch.empty(0, *x.shape[1:], dtype=torch.float64)
    return y, states


def oracle_varlen(bt: Batch, candidates: list[list[int]] | None = None, dt_min=0.0, dt_max=float("inf")):
    """The whole batch: (y [T, H, P] float64, the pool after the step), every sequence from its slot's state
    (zeros when not init); with candidates, sequence i's state after token j < L - 1 goes to candidates[i][j]."""
    pool = bt.pool.clone()
    y = torch.empty(bt.x.shape, dtype=torch.float64)
    for i in range(len(bt.slots)):
        r = slice(bt.query_start[i], bt.query_start[i + 1])
        if r.stop == r.start:
            continue
        s0 = bt.pool[bt.slots[i]] if bt.init[i] else torch.zeros(bt.pool.shape[1:])
        y[r], states = oracle_seq(bt.x[r], bt.dt[r], bt.A_log, bt.B[r], bt.C[r], bt.D, bt.dt_bias, s0, dt_min, dt_max)
        for j, c in enumerate(candidates[i] if candidates else []):
            pool[c] = states[j].float()
        pool[bt.slots[i]] = states[-1].float()
    return y, pool


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output (an element left unwritten, or a poisoned state read?)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
