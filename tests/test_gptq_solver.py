"""The GPTQ solver (weight_formats/gptq_solver.py) and its v1 checkpoint tensors; the same error feedback onto
the FP8 e4m3 grid (weight_formats/fp8_gptq.py).

Oracles: with an identity Hessian GPTQ has nothing to feed back and must equal round-to-nearest; on
correlated inputs it must beat round-to-nearest on the layer's output error (its objective); the packed
tensors must equal the independent test packer's (tests/int4_checkpoints.py) and load through lamina's GPTQ
repacking into exactly the weight the solver says it stored.
"""
from __future__ import annotations

import pytest
import torch
from int4_checkpoints import gptq_tensors

from lamina.kernels.fp8 import quantize_rows
from lamina.kernels.wq_matmul import dequantize
from lamina.models.weight_formats.fp8_gptq import fp8_gptq_quantize, fp8_rtn_quantize
from lamina.models.weight_formats.gptq_solver import gptq_quantize, gptq_v1_tensors, rtn_quantize
from lamina.models.weight_formats.int4_gptq import gptq_layout


def correlated_inputs(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Activations with a few strong, correlated directions and uneven channel scales (like a real layer's)."""
    z = torch.randn(n, k // 4, generator=gen)
    mix = torch.randn(k // 4, k, generator=gen)
    return (z @ mix + 0.3 * torch.randn(n, k, generator=gen)) * torch.rand(k, generator=gen).mul(3).add(0.2)


def test_identity_hessian_is_round_to_nearest():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=gen)
    g = gptq_quantize(w, torch.eye(64), group=32, damp=0.0)
    r = rtn_quantize(w, group=32)
    assert torch.equal(g.q, r.q) and torch.equal(g.zeros, r.zeros) and torch.equal(g.scales, r.scales)


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_gptq_beats_round_to_nearest_on_the_output_error(act_order, sym):
    gen = torch.Generator().manual_seed(1)
    n, k = 48, 128
    x = correlated_inputs(512, k, gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    h = x.T.double() @ x.double() / x.shape[0]
    g = gptq_quantize(w, h, group=32, act_order=act_order, sym=sym)
    r = rtn_quantize(w, group=32, sym=sym)
    want = x.double() @ w.double().T
    err_g = (x.double() @ g.dequantize().double().T - want).norm()
    err_r = (x.double() @ r.dequantize().double().T - want).norm()
    assert err_g < 0.8 * err_r, (err_g, err_r)
    assert g.q.min() >= 0 and g.q.max() <= 15 and g.zeros.min() >= 1  # v1-storable zero points
    if act_order:
        assert not torch.equal(g.g_idx, torch.arange(k, dtype=torch.int32) // 32)
        assert torch.equal(torch.bincount(g.g_idx.long()), torch.full((k // 32,), 32))


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_v1_tensors_match_the_test_packer_and_load_as_the_solved_weight(act_order):
    gen = torch.Generator().manual_seed(2)
    n, k, group = 32, 128, 32
    x = correlated_inputs(256, k, gen)
    w = torch.randn(n, k, generator=gen)
    r = gptq_quantize(w, x.T @ x / 256, group=group, act_order=act_order)
    mine = gptq_v1_tensors(r)
    theirs = gptq_tensors(r.q, r.zeros, r.scales, r.g_idx, v1=True)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        assert torch.equal(mine[name], theirs[name]), name
    q, s, o, perm = gptq_layout(mine["qweight"], mine["qzeros"], mine["scales"], mine["g_idx"], group, True)
    pairs = q.to(torch.uint8).reshape(n, -1, 2)
    stored = dequantize(pairs[..., 0] | (pairs[..., 1] << 4), s, o, 4)
    if perm is not None:
        orig = torch.empty_like(stored)
        orig[:, perm] = stored
        stored = orig
    assert torch.allclose(stored, r.dequantize(), atol=1e-6)


def test_bad_group_is_refused():
    with pytest.raises(ValueError, match="does not divide"):
        gptq_quantize(torch.zeros(8, 48), torch.eye(48), group=32)


@pytest.mark.parametrize("fp8", [False, True], ids=["int4", "fp8"])
def test_row_stacked_weights_solve_as_each_alone(fp8):
    """scripts/gptq_quantize.py solves q|k|v (one input) as one stacked weight: rows are independent given H."""
    gen = torch.Generator().manual_seed(5)
    x = correlated_inputs(256, 64, gen)
    h = x.T @ x / 256
    a, b = torch.randn(16, 64, generator=gen), torch.randn(8, 64, generator=gen)
    solve = (lambda w: fp8_gptq_quantize(w, h)) if fp8 else (lambda w: gptq_quantize(w, h, group=32, act_order=True))
    both = solve(torch.cat([a, b]))
    for part, alone in ((both.rows(slice(0, 16)), solve(a)), (both.rows(slice(16, 24)), solve(b))):
        assert torch.allclose(part.dequantize(), alone.dequantize(), rtol=0, atol=1e-6)


def test_fp8_identity_hessian_is_round_to_nearest():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(24, 64, generator=gen)
    g, r = fp8_gptq_quantize(w, torch.eye(64), damp=0.0), fp8_rtn_quantize(w)
    assert torch.equal(g.q.view(torch.uint8), r.q.view(torch.uint8)) and torch.equal(g.scale, r.scale)
    q, s = quantize_rows(w)  # what online --quantization fp8 stores
    assert torch.equal(r.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(r.scale, s)


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_fp8_feedback_beats_round_to_nearest_on_the_output_error(act_order):
    gen = torch.Generator().manual_seed(7)
    n, k = 48, 128
    x = correlated_inputs(512, k, gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    h = x.T.double() @ x.double() / x.shape[0]
    g, r = fp8_gptq_quantize(w, h, act_order=act_order), fp8_rtn_quantize(w)
    assert g.q.dtype == torch.float8_e4m3fn and torch.equal(g.scale, r.scale)  # same grid, other grid points
    want = x.double() @ w.double().T
    err_g = (x.double() @ g.dequantize().double().T - want).norm()
    err_r = (x.double() @ r.dequantize().double().T - want).norm()
    assert err_g < 0.8 * err_r, (err_g, err_r)
    assert g.q.float().isfinite().all()


def q4_1_like(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Weights already on a GGUF Q4_1-style grid: per 32 columns, min + d * (0..15) with a float min."""
    d = torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 0.005
    m = -d * (torch.rand(n, k // 32, 1, generator=gen) * 15)
    return (m + d * torch.randint(0, 16, (n, k // 32, 32), generator=gen)).reshape(n, k)


def test_mse_fit_lowers_the_rounding_error_of_weights_on_another_grid():
    gen = torch.Generator().manual_seed(8)
    w = q4_1_like(64, 128, gen)
    plain, fit = rtn_quantize(w, group=32), rtn_quantize(w, group=32, mse=True)
    e_plain, e_fit = (plain.dequantize() - w).norm(), (fit.dequantize() - w).norm()
    assert e_fit < 0.85 * e_plain, (e_fit, e_plain)
    assert fit.zeros.min() >= 1 and fit.zeros.max() <= 15 and fit.q.min() >= 0 and fit.q.max() <= 15
    # per group and row, never worse than min-max (the min-max candidate is one of those searched)
    per = lambda r: ((r.dequantize() - w) ** 2).reshape(64, 4, 32).sum(-1)  # noqa: E731
    assert (per(fit) <= per(plain) + 1e-12).all()
    g = torch.randn(16, 64, generator=gen)
    assert torch.equal(gptq_quantize(g, torch.eye(64), group=32, damp=0.0, mse=True).q,
                       rtn_quantize(g, group=32, mse=True).q)  # identity Hessian: still round-to-nearest


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_gptq_with_mse_fit_beats_round_to_nearest(sym):
    gen = torch.Generator().manual_seed(9)
    x = correlated_inputs(512, 128, gen)
    w = q4_1_like(48, 128, gen)
    h = x.T.double() @ x.double() / 512
    want = x.double() @ w.double().T
    err = lambda r: (x.double() @ r.dequantize().double().T - want).norm()  # noqa: E731
    g = gptq_quantize(w, h, group=32, act_order=True, sym=sym, mse=True)
    assert err(g) < 0.8 * err(rtn_quantize(w, group=32, sym=sym, mse=True))
    assert g.zeros.min() >= 1 and g.q.max() <= 15  # still v1-storable
