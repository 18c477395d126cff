"""The gated RMSNorm fused into the out_proj GEMV against the two reference ops (norm rounded to the dtype as
the layer rounds it, then the matmul in float64), on fresh random inputs with the gate a strided view into a
wider projection output, as in the GDN layer. Interpreter: dot configs in fp16/fp32 only (bf16 dots are
computed on raw bits there)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, INTERPRET, TOL, rel_err

from lamina.kernels.norm_gated import rms_norm_gated_linear, rms_norm_gated_linear_ref, rms_norm_gated_ref

# name: (M, Hv, D, N)
CASES = {"m1_h4_d32": (1, 4, 32, 48), "m3_h6_d16_ragged_n": (3, 6, 16, 37), "m5_h2_d64": (5, 2, 64, 40),
         "m16_h3_d32": (16, 3, 32, 24)}
TILES = [None, dict(block_n=4, heads=1, dot=False), dict(block_n=16, heads=2, dot=True)]
PARAMS = [(c, dt, i) for c in CASES for dt in (torch.bfloat16, torch.float16, torch.float32) for i in range(3)]


def _inputs(case, dtype, seed):
    m, hv, d, n = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(m, 3 * hv * d + 5, generator=gen).to(dtype)  # z: a slice of a wider projection row
    z = proj[:, hv * d:2 * hv * d].reshape(m, hv, d)
    x = torch.randn(m, hv, d, generator=gen).to(dtype)
    nw = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    w = (torch.randn(n, hv * d, generator=gen) / (hv * d) ** 0.5).to(dtype)
    return x, z, nw, w


@pytest.mark.parametrize("case,dtype,tiles", PARAMS, ids=[f"{c}-{str(d)[6:]}-t{i}" for c, d, i in PARAMS])
def test_gated_norm_gemv(case, dtype, tiles):
    from lamina.kernels.triton_norm_gated_gemv import default_tiles, gated_norm_gemv

    m, hv, d, n = CASES[case]
    kw = TILES[tiles]
    use_dot = default_tiles(m, n, d)[2] if kw is None else kw["dot"]
    if INTERPRET and use_dot and dtype == torch.bfloat16:
        pytest.skip("interpreter bf16 dots are wrong")
    x, z, nw, w = _inputs(case, dtype, seed=m * 100 + tiles)
    ref = rms_norm_gated_ref(x, z, nw, 1e-6).reshape(m, -1).double() @ w.double().T
    out = gated_norm_gemv(x.to(DEV), z.to(DEV), nw.to(DEV), 1e-6, w.to(DEV), **(kw or {}))
    assert out.shape == (m, n) and out.dtype == dtype
    # The interpreter truncates bf16 casts (three roundings here), so its bf16 errors read ~2x the GPU's.
    tol = TOL[dtype] * (2 if INTERPRET and dtype == torch.bfloat16 else 1)
    assert rel_err(out, ref) < tol


def test_dispatch_on_cpu_is_the_reference_and_refuses_odd_layouts(monkeypatch):
    x, z, nw, w = _inputs("m3_h6_d16_ragged_n", torch.float32, 1)
    assert torch.equal(rms_norm_gated_linear(x, z, nw, 1e-6, w), rms_norm_gated_linear_ref(x, z, nw, 1e-6, w))
    import lamina.kernels.norm_gated as ng

    monkeypatch.setattr(ng, "use_triton", lambda t: True)
    assert rms_norm_gated_linear(x.transpose(0, 1).contiguous().transpose(0, 1), z, nw, 1e-6, w) is None  # head stride
    assert rms_norm_gated_linear(torch.randn(17, 6, 16), torch.randn(17, 6, 16), nw, 1e-6, w) is None  # > 16 tokens
    x6, z6 = torch.randn(2, 4, 24), torch.randn(2, 4, 24)
    assert rms_norm_gated_linear(x6, z6, torch.ones(24), 1e-6, torch.randn(8, 96)) is None  # D not a power of 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter (CI); on CUDA the real "
                    "backend refuses CPU tensors, and the GPU kernel tests cover the kernels")
def test_gdn_layer_dispatch_uses_its_norm_and_out_proj(monkeypatch):
    """fused_norm_out_proj hands the layer's own norm weight, eps and out_proj weight to the fused kernel
    (CUDA check bypassed on a CPU: the kernel runs through the interpreter) and matches the two layer ops."""
    from types import SimpleNamespace

    import lamina.kernels.norm_gated as ng
    from lamina.models.layers import gdn_decode_path
    from lamina.models.layers.gated_delta_net import GatedRMSNorm
    from lamina.models.layers.linear import Linear

    torch.manual_seed(4)
    norm = GatedRMSNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32) + 0.5)
    proj = Linear(4 * 32, 24)
    proj.to_empty(device="cpu")
    with torch.no_grad():
        proj.weight.normal_(std=0.1)
    layer = SimpleNamespace(norm=norm, out_proj=proj)
    core, z = torch.randn(2, 4, 32), torch.randn(2, 4, 32)
    want = proj(norm(core, z).reshape(2, -1))
    for mod in (gdn_decode_path, ng):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    got = gdn_decode_path.fused_norm_out_proj(layer, core, z)
    assert got is not None and rel_err(got, want.double()) < 1e-5
    monkeypatch.setenv("LAMINA_FUSED_GDN_OUT", "0")
    assert gdn_decode_path.fused_norm_out_proj(layer, core, z) is None
