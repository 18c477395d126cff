"""The streaming MoE decode kernels (triton_moe_stream: persistent grid, next tile prefetched) against the torch
references on fresh random inputs, T in {1, 2, 3, 4, 16}, outputs NaN-poisoned so a tile no program writes
shows. On the CPU the grid is 4 programs, so each program walks several tiles and the last round is partial;
widths that do not divide the tiles (H 100, I 24, N blocks past the end) exercise every mask."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, TOL, rel_err, small_sparse_moe

from lamina.kernels.moe_decode import down_sum_ref, gate_up_pairs_ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# name: (T, slots, experts, H, I)
CASES = {
    "t1_s11": (1, 11, 24, 64, 32),
    "t2_s5_h100": (2, 5, 12, 100, 24),
    "t3_s11": (3, 11, 16, 48, 40),
    "t4_s8": (4, 8, 20, 64, 48),
    "t16_s3": (16, 3, 9, 32, 16),
}
PARAMS = [(c, dt, bn) for c in CASES for dt in DTYPES for bn in (1, 2, 8)]


def _nan_empty(*size, dtype=None, device=None):
    return torch.full(size, float("nan"), dtype=dtype, device=device)


def _inputs(case, dtype, seed):
    t, s, e, h, i = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:s] for _ in range(t)])
    weights = torch.rand(t, s, generator=gen).to(dtype)
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("case,dtype,bn", PARAMS, ids=[f"{c}-{str(d)[6:]}-n{b}" for c, d, b in PARAMS])
def test_gate_up_stream(case, dtype, bn, monkeypatch):
    from lamina.kernels import triton_moe_stream as ms

    x, w13, _, ids, _ = _inputs(case, dtype, 3 + bn)
    ref = gate_up_pairs_ref(x.double(), w13.double(), ids)
    monkeypatch.setattr(ms.torch, "empty", _nan_empty)
    out = ms.gate_up_stream(x.to(DEV), w13.to(DEV), ids.to(DEV), block_n=bn, warps=4)
    monkeypatch.undo()
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("case,dtype,bn", PARAMS, ids=[f"{c}-{str(d)[6:]}-n{b}" for c, d, b in PARAMS])
def test_down_stream(case, dtype, bn, monkeypatch):
    from lamina.kernels import triton_moe_stream as ms

    _, _, w2, ids, weights = _inputs(case, dtype, 5 + bn)
    t, s, _, _, i = CASES[case]
    inter = torch.randn(t * s, i, generator=torch.Generator().manual_seed(bn)).to(dtype)
    ref = down_sum_ref(inter.double(), w2.double(), weights.double(), ids)
    monkeypatch.setattr(ms.torch, "empty", _nan_empty)
    out = ms.down_stream(inter.to(DEV), w2.to(DEV), weights.to(DEV), ids.to(DEV), block_n=bn, warps=4)
    monkeypatch.undo()
    assert out.dtype == dtype and out.shape == (t, w2.shape[1])
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("gate_up,down", [("stream", "stream"), ("pair", "sum"), ("stream", "sum"),
                                          ("pair", "stream")])
def test_expert_tiles_agree(gate_up, down):
    """Every ExpertTiles choice computes the same block (bf16, T 3, 11 slots) as the float64 reference."""
    from lamina.kernels.triton_moe_decode import ExpertTiles, experts_triton

    x, w13, w2, ids, weights = _inputs("t3_s11", torch.bfloat16, 1)
    ref = down_sum_ref(gate_up_pairs_ref(x.double(), w13.double(), ids), w2.double(), weights.double(), ids)
    tiles = ExpertTiles(gate_up=gate_up, down=down, gu_block_n=2, down_block_n=1)
    out = experts_triton(x.to(DEV), w13.to(DEV), w2.to(DEV), weights.to(DEV), ids.to(DEV), tiles)
    assert rel_err(out, ref) < 2 * TOL[torch.bfloat16]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter (CI)")
def test_sparse_moe_layer_bf16_takes_the_default_tiles(monkeypatch):
    """A bf16 SparseMoE (shared expert folded) through the fused decode dispatch, whose default tiles (measured
    on the H200) stream gate|up and loop the down+sum, equals the layer's unfused forward within bf16
    rounding; and those kernels did run (counted launches)."""
    from lamina.kernels import triton_moe_decode as tmd
    from lamina.kernels import triton_moe_stream as ms
    from lamina.models import layers

    layer = small_sparse_moe(23, torch.bfloat16)
    layer.fuse_shared_expert()
    x = torch.randn(3, 32).to(torch.bfloat16)
    want = layer(x)  # CPU: the unfused path
    calls = []
    for name in ("gate_up_stream", "down_stream", "down_sum_triton"):
        orig = getattr(tmd, name)
        monkeypatch.setattr(tmd, name, lambda *a, _o=orig, _n=name, **k: calls.append(_n) or _o(*a, **k))
    monkeypatch.setattr(layers.moe_decode_path, "use_triton", lambda t: True)
    import lamina.kernels.moe_decode as md
    monkeypatch.setattr(md, "use_triton", lambda t: True)
    got = layer(x.to(DEV))
    assert calls == ["gate_up_stream", "down_sum_triton"]
    assert ms.stream_programs(torch.device("cpu"), 100, 2) == 4
    assert rel_err(got, want.double()) < 2 * TOL[torch.bfloat16]
