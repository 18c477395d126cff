"""DeepSeek's routing through the fused MoE decode kernels: fp32 router weights and unrounded logits,
routed_scaling_factor, ungated shared experts folded in as always-chosen experts of weight 1. The oracle is
the DeepSeek router's own torch code (layers/moe_routing.grouped_topk, which follows HF transformers) and, for
the whole layer, SparseMoE's unfused forward before its shared experts are folded (CPU tensors through Triton's
interpreter in CI; the kernels on the GPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEV, TOL, rel_err

from lamina.kernels.moe_decode import append_fixed, moe_decode_ref, route_ref
from lamina.models.layers.moe_routing import grouped_topk

# name: (T, E, top_k, H, method, renormalize, scaling, fixed shared experts, n_group, topk_group)
CASES = {
    "v2lite_greedy_t1": (1, 64, 6, 64, "greedy", False, 1.0, 2, 1, 1),
    "greedy_scaled_t5": (5, 32, 4, 48, "greedy", True, 16.0, 1, 1, 1),
    "noaux_one_group_t3": (3, 24, 3, 64, "noaux_tc", True, 2.5, 1, 1, 1),
    "noaux_no_shared_t16": (16, 16, 2, 32, "noaux_tc", False, 2.5, 0, 1, 1),
    "v3_groups_8_keep_4_t2": (2, 64, 8, 64, "noaux_tc", True, 2.5, 1, 8, 4),  # V3's rule, fewer experts
    "v3_groups_t16": (16, 32, 4, 32, "noaux_tc", True, 2.5, 1, 4, 2),
    "limited_greedy_t4": (4, 32, 3, 48, "group_limited_greedy", False, 1.0, 2, 8, 3),
}
PARAMS = [(c, dt) for c in CASES for dt in (torch.bfloat16, torch.float32)]


def _inputs(case, dtype, seed):
    t, e, _, h, method, *_ = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    gw = torch.randn(e, h, generator=gen) / h ** 0.5  # fp32, as GroupedTopKRouter keeps it
    bias = torch.randn(e, generator=gen) * 0.3 if method == "noaux_tc" else None
    return x, gw, bias


def _oracle(x, gw, bias, case):
    _, e, k, _, method, renorm, scaling, fixed, n_group, topk_group = CASES[case]
    w, ids = grouped_topk(F.linear(x.float(), gw), k, method, n_group, topk_group, renorm, scaling, bias)
    return append_fixed(w.to(x.dtype), ids, e, fixed)


def _kw(case):
    """route_ref / route_triton keywords of a case (DeepSeek: fp32 logits)."""
    _, _, _, _, method, _, scaling, fixed, n_group, topk_group = CASES[case]
    return dict(round_logits=False, scale=scaling, fixed=fixed, n_group=n_group, topk_group=topk_group,
                group_top2=method == "noaux_tc")


def _score(method):
    return "sigmoid" if method == "noaux_tc" else "softmax"


@pytest.mark.parametrize("case", list(CASES))
def test_route_ref_is_grouped_topk(case):
    """The fused path's reference routes as the DeepSeek router does."""
    _, _, k, _, method, renorm, _, fixed, _, _ = CASES[case]
    x, gw, bias = _inputs(case, torch.float32, 0)
    w, ids = route_ref(x, gw, k, renorm, False, _score(method), bias, **_kw(case))
    w2, ids2 = _oracle(x, gw, bias, case)
    assert torch.equal(ids, ids2) and torch.allclose(w, w2, rtol=1e-6, atol=1e-7)
    assert (ids[:, k:] == torch.arange(CASES[case][1], CASES[case][1] + fixed)).all() and (w[:, k:] == 1).all()


@pytest.mark.parametrize("case,dtype", PARAMS, ids=[f"{c}-{str(d)[6:]}" for c, d in PARAMS])
def test_route_kernel_deepseek(case, dtype):
    """Kernel vs the DeepSeek router: fp32 logits (no rounding to x's dtype), so the choice matches exactly
    (fresh random logits have no fp32 near-ties at these sizes); weights within the dtype's rounding."""
    from lamina.kernels.triton_moe_decode import new_route_counter, route_triton

    _, e, k, _, method, renorm, _, fixed, _, _ = CASES[case]
    counter = new_route_counter(DEV)
    for seed in range(2):  # the second launch relies on the first having reset the counter
        x, gw, bias = _inputs(case, dtype, seed)
        w, ids = route_triton(x.to(DEV), gw.to(DEV), k, renorm, False, counter, _score(method),
                              bias.to(DEV) if bias is not None else None, **_kw(case))
        assert int(counter.item()) == 0, "arrival counter not reset"
        want_w, want_ids = _oracle(x, gw, bias, case)
        assert w.dtype == dtype and w.shape == (x.shape[0], k + fixed)
        assert torch.equal(ids.cpu()[:, :k].sort(-1).values, want_ids[:, :k].sort(-1).values)
        assert torch.equal(ids.cpu()[:, k:], want_ids[:, k:])
        order, want_order = ids.cpu().argsort(-1), want_ids.argsort(-1)
        assert rel_err(w.cpu().gather(1, order), want_w.gather(1, want_order).double()) < TOL[dtype]


@pytest.mark.parametrize("case", list(CASES))
def test_moe_decode_deepseek_path(case):
    """The three launches (route, gate|up, down+sum over routed and folded shared experts) against the torch
    reference in float64 on the same routing."""
    from lamina.kernels.triton_moe_decode import moe_decode_triton, new_route_counter

    t, e, k, h, method, renorm, _, fixed, _, _ = CASES[case]
    i = 32
    x, gw, bias = _inputs(case, torch.float32, 3)
    gen = torch.Generator().manual_seed(4)
    w13 = torch.randn(e + fixed, 2 * i, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e + fixed, h, i, generator=gen) / i ** 0.5
    kw = _kw(case)
    out = moe_decode_triton(x.to(DEV), gw.to(DEV), w13.to(DEV), w2.to(DEV), k, renorm, False, new_route_counter(DEV),
                            _score(method), bias.to(DEV) if bias is not None else None, **kw)
    ref = moe_decode_ref(x.double(), gw.double(), w13.double(), w2.double(), k, renorm, False, _score(method),
                         bias.double() if bias is not None else None, **kw)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter (CI); on CUDA the real "
                    "backend refuses CPU tensors, and the kernel tests above cover the kernels")
@pytest.mark.parametrize("method,n_group,topk_group", [("greedy", 1, 1), ("noaux_tc", 1, 1),
                                                        ("group_limited_greedy", 4, 4), ("noaux_tc", 4, 2),
                                                        ("group_limited_greedy", 8, 3)])
def test_deepseek_layer_fused_path(method, n_group, topk_group, monkeypatch):
    """A DeepSeek SparseMoE: unfused and unfolded (the HF-shaped oracle) == folded (shared experts as experts
    E, E+1) == the fused decode path, binding groups included (16 experts: powers of two)."""
    from lamina.models import layers
    from lamina.models.config import LayerSpec, ModelConfig, MoESpec
    from lamina.models.layers.moe import SparseMoE

    torch.manual_seed(5)
    cfg = ModelConfig(family="deepseek_v3", vocab_size=8, hidden_size=32, intermediate_size=16, num_heads=2,
                      num_kv_heads=2, head_dim=16, layers=[LayerSpec("mla", "moe")],
                      moe=MoESpec(num_experts=16, top_k=3, intermediate_size=16, renormalize=method == "noaux_tc",
                                  topk_method=method, n_group=n_group, topk_group=topk_group,
                                  routed_scaling_factor=2.5, shared_experts_intermediate_size=32))
    with torch.device("meta"):
        layer = SparseMoE(cfg)
    layer.to_empty(device="cpu")
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(4, 32)
    want = layer(x)
    layer.fuse_shared_expert()
    assert layer.fixed_shared == 2 and layer.shared_experts is None and layer.experts.num_experts == 18
    assert layer.experts_per_token == 5
    assert rel_err(layer(x), want.double()) < 1e-5  # CPU: the unfused path over the folded stacks
    monkeypatch.setattr(layers.moe_decode_path, "use_triton", lambda t: True)
    import lamina.kernels.moe_decode as md
    monkeypatch.setattr(md, "use_triton", lambda t: True)
    fused = layers.moe_decode_path.fused_decode(layer, x.to(DEV))
    assert fused is not None and torch.equal(layer.route_counter.get(DEV), torch.zeros(1, dtype=torch.int32))
    assert rel_err(fused, want.double()) < 1e-5
