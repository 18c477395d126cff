"""The fused GDN conv + recurrent decode step against the two unfused references on fresh random inputs:
the core output, the conv and recurrent states of the used slots (twice in a row: the second step starts from
the states the first wrote), untouched (NaN-poisoned) spare slots, fresh sequences that must not read their
slot, and counters left at zero."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, TOL, rel_err

from lamina.kernels.gdn_conv_decode import gdn_conv_decode_ref

# name: (B, Hk, dk, Hv, dv, conv kernel, bias, block_v)
CASES = {
    "b1_group2": (1, 2, 16, 4, 32, 4, False, None),
    "b3_group1_bias": (3, 2, 32, 2, 16, 4, True, 8),
    "b2_k2_group4": (2, 1, 16, 4, 16, 2, False, 8),
    "b4_k3_vsplit": (4, 2, 16, 4, 32, 3, False, 8),
}
PARAMS = [(c, dt) for c in CASES for dt in (torch.bfloat16, torch.float16, torch.float32)]


@pytest.mark.parametrize("case,dtype", PARAMS, ids=[f"{c}-{str(d)[6:]}" for c, d in PARAMS])
def test_gdn_conv_decode(case, dtype):
    from lamina.kernels.triton_gdn_conv_decode import gdn_conv_decode_triton, new_conv_counters

    bsz, hk, dk, hv, dv, kw, bias, block_v = CASES[case]
    gen = torch.Generator().manual_seed(bsz * 10 + hv)
    c = 2 * hk * dk + hv * dv
    n_slots = bsz + 3
    slots = torch.randperm(n_slots, generator=gen)[:bsz]
    has_init = [i % 3 != 1 for i in range(bsz)]  # every third sequence starts fresh: its slot holds NaN
    conv_w = (torch.randn(c, kw, generator=gen) / kw ** 0.5).to(dtype)
    conv_b = (torch.randn(c, generator=gen) * 0.1).to(dtype) if bias else None
    a_log = torch.rand(hv, generator=gen)
    dt_bias = torch.randn(hv, generator=gen) * 0.5
    conv_pool = torch.full((n_slots, c, kw - 1), float("nan")).to(dtype)
    ssm_pool = torch.full((n_slots, hv, dk, dv), float("nan"))
    for i, s in enumerate(slots.tolist()):
        if has_init[i]:
            conv_pool[s] = torch.randn(c, kw - 1, generator=gen).to(dtype)
            ssm_pool[s] = torch.randn(hv, dk, dv, generator=gen) * 0.1
    ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.clone()
    conv_d, ssm_d = conv_pool.to(DEV), ssm_pool.to(DEV)
    counters = new_conv_counters(bsz, hk, DEV)
    init = torch.tensor(has_init)
    for step in range(2):
        proj = torch.randn(bsz, c + 2 * hv + 7, generator=gen).to(dtype)  # x, a, b: views into one projection
        x, a, b = proj[:, :c], proj[:, c:c + hv], proj[:, c + hv:c + 2 * hv]
        flags = has_init if step == 0 else [True] * bsz
        want = gdn_conv_decode_ref(x, conv_w, conv_b, ref_conv, a, b, a_log, dt_bias, ref_ssm, slots.tolist(), flags,
                                   hk, dk, hv, dv)
        got = gdn_conv_decode_triton(x.to(DEV), conv_w.to(DEV), conv_b.to(DEV) if bias else None, conv_d, a.to(DEV),
                                     b.to(DEV), a_log.to(DEV), dt_bias.to(DEV), ssm_d, slots.to(DEV),
                                     (init if step == 0 else torch.ones(bsz, dtype=torch.bool)).to(DEV), counters,
                                     hk, dk, hv, dv, block_v=block_v)
        assert int(counters.abs().sum()) == 0, "counters not reset"
        tol = TOL[dtype] * (3 if dtype != torch.float32 else 1)  # conv rounding, then the recurrence
        assert rel_err(got, want) < tol, (step, rel_err(got, want))
        used = slots.tolist()
        assert rel_err(conv_d[used], ref_conv[used]) < TOL[dtype]
        assert rel_err(ssm_d[used], ref_ssm[used]) < tol
        spare = [s for s in range(n_slots) if s not in used]
        assert conv_d[spare].isnan().all() and ssm_d[spare].isnan().all(), "a spare slot was written"


def test_gdn_conv_decode_without_pools():
    """No pools bound (a profiling pass): zero states, nothing written, no counters touched."""
    from lamina.kernels.triton_gdn_conv_decode import gdn_conv_decode_triton, new_conv_counters

    gen = torch.Generator().manual_seed(0)
    hk, dk, hv, dv, kw = 1, 16, 2, 16, 4
    c = 2 * hk * dk + hv * dv
    x, a, b = torch.randn(2, c, generator=gen), torch.randn(2, hv, generator=gen), torch.randn(2, hv, generator=gen)
    w = torch.randn(c, kw, generator=gen)
    a_log, dtb = torch.rand(hv, generator=gen), torch.randn(hv, generator=gen)
    want = gdn_conv_decode_ref(x, w, None, None, a, b, a_log, dtb, None, None, [False, False], hk, dk, hv, dv)
    counters = new_conv_counters(2, hk, DEV)
    got = gdn_conv_decode_triton(x.to(DEV), w.to(DEV), None, None, a.to(DEV), b.to(DEV), a_log.to(DEV), dtb.to(DEV),
                                 None, None, None, counters, hk, dk, hv, dv)
    assert rel_err(got, want) < TOL[torch.float32]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter (CI); on CUDA the real "
                    "backend refuses CPU tensors, and the GPU kernel tests cover the kernels")
def test_gdn_layer_decode_fusions_match_the_unfused_layer(monkeypatch):
    """A GatedDeltaNet decode step through both decode fusions (conv + recurrent step, gated norm + out_proj;
    the CUDA check bypassed so they run through the interpreter) against the same layer's unfused CPU path:
    output and both state pools."""
    import lamina.kernels.norm_gated as ng
    from lamina.kernels.attention import AttentionMetadata
    from lamina.kernels.metadata import StateMetadata, StepContext
    from lamina.models.config import GatedDeltaNetSpec, LayerSpec, ModelConfig
    from lamina.models.layers import gdn_decode_path
    from lamina.models.layers.gated_delta_net import GatedDeltaNet

    torch.manual_seed(8)
    cfg = ModelConfig(family="t", vocab_size=8, hidden_size=32, intermediate_size=16, num_heads=2, num_kv_heads=2,
                      head_dim=16, layers=[LayerSpec("gated_delta_net")],
                      gdn=GatedDeltaNetSpec(num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16))
    layer = GatedDeltaNet(cfg, cfg.layers[0])
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)
        layer.norm.weight.add_(1.0)
    slots, init = [3, 0, 5], [True, False, True]
    conv = torch.randn(7, layer.conv_dim, 3)
    ssm = torch.randn(7, 2, 16, 16) * 0.1
    meta = AttentionMetadata(torch.full((3,), -1, dtype=torch.long), torch.arange(4, dtype=torch.int32),
                             torch.ones(3, dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int32), [0, 1, 2, 3],
                             [1, 1, 1], 1, 1)
    ctx = StepContext(meta, StateMetadata(torch.tensor(slots), torch.tensor(init), slots, init))
    x = torch.randn(3, 32)
    layer.bind_state({"conv": conv.clone(), "ssm": ssm.clone()})
    want = layer(x, torch.zeros(3, dtype=torch.long), ctx)
    want_conv, want_ssm = layer.conv_state.clone(), layer.ssm_state.clone()
    layer.bind_state({"conv": conv.clone(), "ssm": ssm.clone()})
    for mod in (gdn_decode_path, ng):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    got = layer(x, torch.zeros(3, dtype=torch.long), ctx)
    assert layer.conv_counters._counters is not None, "the fused conv + recurrent kernel did not run"
    assert rel_err(got, want) < 1e-4
    assert rel_err(layer.conv_state[slots], want_conv[slots]) < 1e-6
    assert rel_err(layer.ssm_state[slots], want_ssm[slots]) < 1e-4
    monkeypatch.setenv("LAMINA_FUSED_GDN_CONV", "0")
    qkv = torch.randn(3, layer.conv_dim)
    assert gdn_decode_path.fused_conv_recurrent(layer, qkv, x[:, :2], x[:, 2:4], ctx) is None
