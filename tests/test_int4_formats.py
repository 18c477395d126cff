"""GPTQ (symmetric, asymmetric, act-order, v1 and v2), AWQ and compressed-tensors int4 pack-quantized
layers: checkpoint tensors written to each published definition (tests/int4_checkpoints.py), loaded part
by part into a fused q|k|v Linear, repacked; the layer's weight and output against the dense weight the
integers define, on the reference path and the CPU int4 path. compressed-tensors' own unpacker cross-checks
its packing. Unsupported widths, group sizes and wrong shapes are refused."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from int4_checkpoints import awq_tensors, ct_tensors, dense_weight, gptq_tensors, random_quant

from lamina.models.layers.linear import Linear
from lamina.models.weight_formats.int4_ct import CTInt4Format, choose_ct_int4
from lamina.models.weight_formats.int4_gptq import AWQFormat, GPTQFormat, choose_awq, choose_gptq

K, SIZES, GROUP = 256, {"q": 64, "k": 32, "v": 32}, 64


def _layer(fmt, bias=False):
    with torch.device("meta"):
        layer = Linear(K, SIZES, bias=bias, fmt=fmt)
    return layer.to_empty(device="cpu")


def _load(layer, shard, tensors):
    for name, t in tensors.items():
        layer.weight_loaders[name].loader(layer, getattr(layer, name), t, shard)


def _check(layer, ref):
    torch.testing.assert_close(layer.format.dequantized(layer, torch.float32), ref, atol=ref.abs().max().item() * 2e-3,
                               rtol=0)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    want = x.double() @ ref.double().t()
    got = layer(x)
    assert ((got - want).norm() / want.norm()).item() < 5e-3  # bf16 activations on the CPU int4 path
    layer.__dict__.pop("_cpu_pack", None)
    layer.__dict__.pop("_cpu_dense", None)
    got = layer(x)  # the reference path: dequantize, fp32 matmul
    assert ((got - want).norm() / want.norm()).item() < 1e-3


def _build(fmt, writer, act_order=False, sym=False, **kw):
    layer = _layer(fmt)
    g_idx_shared = None
    refs = []
    for i, (shard, n) in enumerate(SIZES.items()):
        q, z, s, g_idx = random_quant(n, K, GROUP, seed=i, act_order=act_order, sym=sym)
        if act_order:  # q, k and v share one input and so one activation order
            g_idx_shared = g_idx if g_idx_shared is None else g_idx_shared
            g_idx = g_idx_shared
        _load(layer, shard, writer(q, z, s, g_idx, **kw))
        refs.append(dense_weight(q, z, s, g_idx))
    layer.format.finish_loading(layer)
    return layer, torch.cat(refs)


@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "act-order"])
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("v1", [True, False], ids=["gptq", "gptq_v2"])
def test_gptq(act_order, sym, v1):
    layer, ref = _build(GPTQFormat(4, GROUP, zero_plus_one=v1), gptq_tensors, act_order, sym, v1=v1)
    assert (layer.__dict__["_perm"] is not None) == act_order
    assert layer.weight.dtype == torch.uint8 and not hasattr(layer, "qweight")
    _check(layer, ref)


def test_awq():
    layer, ref = _build(AWQFormat(4, GROUP), lambda q, z, s, g: awq_tensors(q, z, s))
    _check(layer, ref)


@pytest.mark.parametrize("sym,act_order", [(True, False), (False, False), (True, True)],
                         ids=["sym", "asym", "sym-actorder"])
def test_compressed_tensors_pack_quantized(sym, act_order):
    pytest.importorskip("compressed_tensors")
    fmt = choose_ct_int4({"weights": {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group",
                                      "group_size": GROUP, "actorder": "group" if act_order else None}},
                         "model.layers.0.self_attn.qkv_proj", _layer(None))
    assert isinstance(fmt, CTInt4Format)
    layer, ref = _build(fmt, lambda q, z, s, g: ct_tensors(q, z, s, g if act_order else None, sym), act_order,
                        sym)
    _check(layer, ref)


def test_compressed_tensors_own_unpacker_agrees():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from lamina.models.weight_formats.int4_native import unpack_int32

    q, z, s, _ = random_quant(16, K, GROUP, seed=3)
    t = ct_tensors(q, z, s, None, sym=False)
    torch.testing.assert_close(unpack_int32(t["weight_packed"], 1) - 8,
                               unpack_from_int32(t["weight_packed"], 4, torch.Size([16, K])).int())
    zs = unpack_from_int32(t["weight_zero_point"], 4, torch.Size([16, K // GROUP]), packed_dim=0)
    torch.testing.assert_close(unpack_int32(t["weight_zero_point"], 0) - 8, zs.int())


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="unsupported weight bit width 3; supported: 4"):
        choose_gptq({"bits": 3, "group_size": 128}, None)
    with pytest.raises(ValueError, match="unsupported group size 100"):
        choose_gptq({"bits": 4, "group_size": 100}, None)
    with pytest.raises(ValueError, match="group_size -1"):
        choose_gptq({"bits": 4, "group_size": -1}, None)
    with pytest.raises(ValueError, match="unsupported AWQ version 'gemv'"):
        choose_awq({"bits": 4, "group_size": 128, "version": "gemv"}, None)
    with pytest.raises(ValueError, match="supported: int4"):
        choose_ct_int4({"num_bits": 8, "type": "int"}, "x", _layer(None))
    with pytest.raises(ValueError, match="group size 48 for 256 input features"):
        _layer(GPTQFormat(4, 48))


def test_wrong_shapes_are_refused():
    layer = _layer(GPTQFormat(4, GROUP))
    q, z, s, g = random_quant(64, K, GROUP, seed=0)
    t = gptq_tensors(q, z, s, g)
    with pytest.raises(ValueError, match="shard 'q' of scales expects shape"):
        _load(layer, "q", {**t, "scales": t["scales"][:2]})
    with pytest.raises(ValueError, match="expects shape"):
        _load(layer, "k", t)  # q's 64 rows into k's 32
    if importlib.util.find_spec("compressed_tensors") is None:
        return  # the packer below is compressed-tensors' own
    layer = _layer(CTInt4Format(GROUP, True, False))
    for shard, n in SIZES.items():
        q, z, s, g = random_quant(n, K, GROUP, seed=0)
        _load(layer, shard, {**ct_tensors(q, z, s), "weight_shape": torch.tensor([n + 1, K])})
    with pytest.raises(ValueError, match="weight_shape"):
        layer.format.finish_loading(layer)


@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "act-order"])
def test_gptq_experts(act_order):
    """A GPTQ expert stack loaded expert by expert (gate, up, down), against the dense MoE reference on the
    weights the integers define."""
    from lamina.kernels.moe import fused_moe_ref
    from lamina.models.layers.moe import FusedExperts
    from lamina.models.weight_formats.int4_experts import GPTQExperts

    e, h, i = 4, 64, 32
    with torch.device("meta"):
        layer = FusedExperts(e, h, i, fmt=GPTQExperts(4, 32))
    layer = layer.to_empty(device="cpu")
    w13, w2 = [], []
    for x in range(e):
        dense, g_idx = {}, {}
        for shard, (n, k) in (("gate", (i, h)), ("up", (i, h)), (None, (h, i))):
            q, z, s, g = random_quant(n, k, 32, seed=10 * x + len(dense), act_order=act_order)
            g = g_idx.setdefault(k if shard else "down", g)  # gate and up share one input: one order
            proj = "down_proj" if shard is None else "gate_up_proj"
            for name, t in gptq_tensors(q, z, s, g).items():
                layer.weight_loaders[f"{proj}_{name}"].loader(layer, getattr(layer, f"{proj}_{name}"), t, shard, x)
            dense[shard] = dense_weight(q, z, s, g)
        w13.append(torch.cat([dense["gate"], dense["up"]]))
        w2.append(dense[None])
    layer.format.finish_loading(layer)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=gen)
    want = fused_moe_ref(x.double(), torch.stack(w13).double(), torch.stack(w2).double(), weights.double(), ids)
    got = layer(x, weights, ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-3
