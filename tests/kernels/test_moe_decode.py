"""The MoE decode kernels (routing in one launch, down projection with the sum over experts folded in) against
torch references on fresh random inputs, outputs NaN-poisoned where a kernel writes. No tl.dot anywhere, so
bf16 runs under the interpreter too. Routing is compared token by token except where the reference's k-th
and (k+1)-th selection scores are a near-tie (a one-ulp logit difference may then pick either)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, TOL, rel_err, small_sparse_moe

from lamina.kernels.moe import fused_moe_ref, select_experts
from lamina.kernels.moe_decode import RouteCounter, down_sum_ref, moe_decode, moe_decode_ref, route_ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# name: (T, E routed, top_k, H, shared, renormalize, score, selection bias)
ROUTE_CASES = {
    "t1_e16_k2": (1, 16, 2, 64, False, True, "softmax", False),
    "t3_e40_k4_shared": (3, 40, 4, 48, True, True, "softmax", False),
    "t16_e64_k8_norenorm": (16, 64, 8, 96, False, False, "softmax", False),
    "t5_e32_k10_shared_h100": (5, 32, 10, 100, True, True, "softmax", False),
    "t2_e24_k3_sigmoid": (2, 24, 3, 64, False, True, "sigmoid", False),
    "t7_e24_k3_sigmoid_bias": (7, 24, 3, 64, False, True, "sigmoid", True),
}
ROUTE_PARAMS = [(c, dt) for c in ROUTE_CASES for dt in DTYPES]


def _route_inputs(case, dtype, seed):
    t, e, _, h, shared, _, _, has_bias = ROUTE_CASES[case]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    gw = (torch.randn(e + int(shared), h, generator=gen) / h ** 0.5).to(dtype)  # O(1) logits, as routers give
    bias = torch.randn(e, generator=gen) * 0.5 if has_bias else None
    return x, gw, bias


def _ulp_slack(x, logits):
    """How far one rounding of the logits to x's dtype may move them (per token, in logit units): the kernel
    and the reference accumulate in different orders, so their rounded logits may differ by an ulp."""
    return 2 * torch.finfo(x.dtype).eps * logits.abs().amax(-1)


def _scores(logits, score, bias):
    probs = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    return probs, (probs + bias if bias is not None else probs)


def _near_tie(x, gw, k, shared, score, bias):
    """Tokens whose k-th and (k+1)-th selection scores are within the rounding slack (either may be chosen)."""
    logits = (x.double() @ gw.double().T)[:, :gw.shape[0] - int(shared)]
    probs, sel = _scores(logits, score, bias)
    top = torch.topk(sel, k + 1, dim=-1).values
    slope = top[:, k - 1] if score == "softmax" else 0.25
    return (top[:, k - 1] - top[:, k]) < 2 * _ulp_slack(x, logits) * slope


@pytest.mark.parametrize("case,dtype", ROUTE_PARAMS, ids=[f"{c}-{str(d)[6:]}" for c, d in ROUTE_PARAMS])
def test_route(case, dtype):
    """The kernel's choice must be a top k of the reference scores (up to the logits' rounding slack), its
    weights the reference's scores of the experts it chose (renormalized over them), and the folded shared
    expert last; where no near-tie exists the choice must be exactly the reference's."""
    from lamina.kernels.triton_moe_decode import new_route_counter, route_triton

    t, e, k, h, shared, renorm, score, _ = ROUTE_CASES[case]
    counter = new_route_counter(DEV)
    for seed in range(2):  # the second launch relies on the first having reset the counter
        x, gw, bias = _route_inputs(case, dtype, seed)
        w, ids = route_triton(x.to(DEV), gw.to(DEV), k, renorm, shared, counter, score,
                              bias.to(DEV) if bias is not None else None)
        assert int(counter.item()) == 0, "arrival counter not reset"
        assert w.shape == (t, k + int(shared)) and ids.dtype == torch.int64
        w, ids = w.cpu().double(), ids.cpu()
        logits = (x.double() @ gw.double().T)
        probs, sel = _scores(logits[:, :e], score, bias)
        routed = ids[:, :k]
        assert all(len(set(r.tolist())) == k for r in routed) and int(routed.max()) < e
        slope = probs.amax(-1) if score == "softmax" else 0.25
        kth = torch.topk(sel, k, dim=-1).values[:, -1]
        assert (sel.gather(1, routed).amin(-1) >= kth - 2 * _ulp_slack(x, logits) * slope).all()
        want = probs.gather(1, routed)
        if renorm:
            want = want / want.sum(-1, keepdim=True)
        if shared:
            assert (ids[:, -1] == e).all()
            want = torch.cat([want, torch.sigmoid(logits[:, -1:])], 1)
        tol = max(TOL[dtype], 2 * float(_ulp_slack(x, logits).max()))
        assert rel_err(w, want) < tol, (rel_err(w, want), tol)
        ref_w, ref_ids = route_ref(x, gw, k, renorm, shared, score, bias)
        for row in torch.nonzero(~_near_tie(x, gw, k, shared, score, bias)).flatten().tolist():
            assert sorted(ids[row].tolist()) == sorted(ref_ids[row].tolist()), (row, ids[row], ref_ids[row])


def test_route_ref_matches_select_experts():
    gen = torch.Generator().manual_seed(3)
    x, gw = torch.randn(6, 32, generator=gen), torch.randn(17, 32, generator=gen)
    for shared in (False, True):
        w, ids = route_ref(x, gw, 4, True, shared)
        w2, ids2 = select_experts(x @ gw.T, 4, True, shared)
        assert torch.equal(ids, ids2) and torch.allclose(w, w2)


# name: (T, S slots, E, H, I, block_n, block_k)
DOWN_CASES = {
    "t1_s11_e12": (1, 11, 12, 64, 32, 4, None),
    "t4_s3_ragged": (4, 3, 6, 50, 40, 4, 16),  # H not a multiple of block_n, I of block_k
    "t16_s9_e20": (16, 9, 20, 32, 48, 8, 32),
    "t2_s1": (2, 1, 3, 16, 16, 2, None),
}
DOWN_PARAMS = [(c, dt) for c in DOWN_CASES for dt in DTYPES]


@pytest.mark.parametrize("case,dtype", DOWN_PARAMS, ids=[f"{c}-{str(d)[6:]}" for c, d in DOWN_PARAMS])
def test_down_sum(case, dtype):
    from lamina.kernels.triton_moe_decode import down_sum_triton

    t, s, e, h, i, bn, bk = DOWN_CASES[case]
    gen = torch.Generator().manual_seed(7 + t)
    inter = torch.randn(t * s, i, generator=gen).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:s] for _ in range(t)])
    weights = torch.rand(t, s, generator=gen).to(dtype)
    ref = down_sum_ref(inter.double(), w2.double(), weights.double(), ids)
    out = down_sum_triton(inter.to(DEV), w2.to(DEV), weights.to(DEV), ids.to(DEV), block_n=bn, block_k=bk)
    assert out.dtype == dtype and out.shape == (t, h)
    assert rel_err(out, ref) < TOL[dtype]


# name: (T, E routed, top_k, H, I, shared)
MOE_CASES = {
    "t1_e16_k4_shared": (1, 16, 4, 64, 32, True),
    "t3_e32_k10": (3, 32, 10, 48, 24, False),
    "t16_e8_k2_shared": (16, 8, 2, 32, 16, True),
}
MOE_PARAMS = [(c, dt) for c in MOE_CASES for dt in DTYPES]


@pytest.mark.parametrize("case,dtype", MOE_PARAMS, ids=[f"{c}-{str(d)[6:]}" for c, d in MOE_PARAMS])
def test_moe_decode_path(case, dtype):
    """The three launches against fused_moe_ref in float64 on the kernel's own routing (tested above), and the
    routing against the reference's where no near-tie makes it ambiguous."""
    from lamina.kernels.triton_moe_decode import moe_decode_triton, new_route_counter, route_triton

    t, e, k, h, i, shared = MOE_CASES[case]
    gen = torch.Generator().manual_seed(11 + t)
    et = e + int(shared)
    x = torch.randn(t, h, generator=gen).to(dtype)
    gw = (torch.randn(et, h, generator=gen) / h ** 0.5).to(dtype)
    w13 = (torch.randn(et, 2 * i, h, generator=gen) / h ** 0.5).to(dtype)
    w2 = (torch.randn(et, h, i, generator=gen) / i ** 0.5).to(dtype)
    counter = new_route_counter(DEV)
    args = (x.to(DEV), gw.to(DEV), w13.to(DEV), w2.to(DEV), k, True, shared, counter)
    out = moe_decode_triton(*args)
    w, ids = route_triton(args[0], args[1], k, True, shared, counter)
    oracle = fused_moe_ref(x.double(), w13.double(), w2.double(), w.double().cpu(), ids.cpu())
    assert rel_err(out, oracle) < 2 * TOL[dtype]
    if not _near_tie(x, gw, k, shared, "softmax", None).any():
        ref = moe_decode_ref(x.double(), gw.double(), w13.double(), w2.double(), k, True, shared)
        assert rel_err(out, ref) < 2 * TOL[dtype]


def test_moe_decode_dispatch_on_cpu_is_the_reference():
    gen = torch.Generator().manual_seed(5)
    x, gw = torch.randn(2, 32, generator=gen), torch.randn(9, 32, generator=gen)
    w13, w2 = torch.randn(9, 32, 32, generator=gen), torch.randn(9, 32, 16, generator=gen)
    got = moe_decode(x, gw, w13, w2, 2, True, True, RouteCounter())
    want = fused_moe_ref(x, w13, w2, *select_experts(x @ gw.T, 2, True, True))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter (CI); on CUDA the real "
                    "backend refuses CPU tensors, and the GPU kernel tests cover the kernels")
@pytest.mark.parametrize("fold", [True, False])
def test_sparse_moe_layer_fused_path(fold, monkeypatch):
    """SparseMoE's decode dispatch hands the layer's own tensors (router rows incl. the folded shared gate,
    stacked experts) to the fused kernels: the result equals the layer's unfused forward. On a CPU the
    dispatch's CUDA check is bypassed so the kernels run through the interpreter on the layer's weights."""
    from lamina.models import layers

    layer = small_sparse_moe(21, torch.float32)
    if fold:
        layer.fuse_shared_expert()
        assert layer.shared_fused
    x = torch.randn(4, 32)
    want = layer(x)  # CPU: the unfused path
    monkeypatch.setattr(layers.moe_decode_path, "use_triton", lambda t: True)
    import lamina.kernels.moe_decode as md
    monkeypatch.setattr(md, "use_triton", lambda t: True)
    got = layer(x.to(DEV))
    assert torch.equal(layer.route_counter.get(DEV), torch.zeros(1, dtype=torch.int32))
    assert rel_err(got, want.double()) < 1e-5
    monkeypatch.setenv("LAMINA_FUSED_MOE_DECODE", "0")
    assert layers.moe_decode_path.fused_decode(layer, x) is None


def test_fused_path_refuses_binding_groups(monkeypatch):
    """DeepSeek's group-limited top-k where the groups bind over a non-power-of-two expert count (V2's 160
    experts in 8 groups keep 3) is not what the routing kernel computes: such a layer keeps its unfused path
    even where the fused one would run (the routings it does take are tested in test_moe_decode_deepseek.py)."""
    from types import SimpleNamespace

    from lamina.models.layers import moe_decode_path

    monkeypatch.setattr(moe_decode_path, "use_triton", lambda x: True)
    gate = SimpleNamespace(method="group_limited_greedy", n_group=8, topk_group=3, weight=torch.empty(160, 8))
    layer = SimpleNamespace(grouped=True, gate=gate)  # no experts: touching them would raise
    assert moe_decode_path.fused_decode(layer, torch.randn(2, 8)) is None
