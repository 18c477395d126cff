"""The grouped MoE GEMMs over quantized expert stacks (FP8 rows / blocks, 4- and 8-bit grouped integers)
against fused_moe_ref on the dequantized stacks in float64, on fresh random inputs: uneven expert loads,
experts with no tokens, ragged tiles, both layout builders, act-order column permutations.

On a CPU through Triton's interpreter (fp16 / fp32: its bf16 dots are wrong), natively on a GPU (bf16 too).
"""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, INTERPRET, TOL, rel_err

from lamina.kernels.fp8 import dequantize, quantize_blocks, quantize_rows
from lamina.kernels.moe import fused_moe_ref
from lamina.kernels.wq_matmul import dequantize as wq_dequantize

DTYPES = [torch.float16, torch.float32] + ([] if INTERPRET else [torch.bfloat16])
SMALL = (16, 32, 32, 32, 32, 4, 2)  # MoeTiles: several N and K tiles at the tiny shapes below
PREFILL = (64, 32, 64, 64, 32, 4, 2)


def routing(t, e, k, gen, experts=None, skew=False):
    """(weights [T, k], ids [T, k]): distinct experts per token from `experts` (default all); skew makes the
    first expert of the pool take (almost) every token, the others a few."""
    pool = torch.tensor(experts) if experts is not None else torch.arange(e)
    rows = []
    for _ in range(t):
        perm = torch.randperm(len(pool), generator=gen)
        if skew and torch.rand((), generator=gen) < 0.9:
            perm = torch.cat([perm[perm == 0], perm[perm != 0]])
        rows.append(pool[perm[:k]])
    return torch.rand(t, k, generator=gen), torch.stack(rows)


# name: (T, E, k, H, I, experts routed to (None: all), skewed loads, tiles, align)
CASES = {
    "uneven_default_tiles": (40, 8, 2, 64, 32, None, True, None, None),
    "empty_experts_small_tiles": (24, 16, 3, 64, 48, (1, 4, 9, 13), False, SMALL, None),
    "ragged_dims_torch_layout": (37, 6, 2, 80, 48, None, True, SMALL, "torch"),
    "prefill_tiles_one_expert_hot": (70, 8, 2, 64, 32, (0, 3, 5), True, PREFILL, None),
}


def moe_tiles(tiles):
    from lamina.kernels.triton_moe import MoeTiles  # kernel modules load after the interpreter is switched on

    return None if tiles is None else MoeTiles(*tiles)


def fp8_stacks(e, h, i, block, gen):
    stacks = []
    for n, k in ((2 * i, h), (h, i)):
        w = torch.randn(e, n, k, generator=gen) / k ** 0.5
        qs = [quantize_blocks(w[j], block) if block else quantize_rows(w[j]) for j in range(e)]
        stacks += [torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])]
    return stacks


@pytest.mark.parametrize("block", [None, (16, 32), (32, 16)], ids=["rows", "block16x32", "block32x16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_fp8_grouped_moe_matches_the_dequantized_reference(case, block, dtype):
    from lamina.kernels.triton_fp8_moe_gemm import fp8_moe_grouped

    t, e, k, h, i, experts, skew, tiles, align = CASES[case]
    gen = torch.Generator().manual_seed(len(case) * 7 + (block or (0, 0))[1])
    w13, s13, w2, s2 = fp8_stacks(e, h, i, block, gen)
    weights, ids = routing(t, e, k, gen, experts, skew)
    x = torch.randn(t, h, generator=gen).to(dtype)
    ref = fused_moe_ref(x.double(), dequantize(w13, s13, block).double(), dequantize(w2, s2, block).double(),
                        weights.double(), ids)
    out = fp8_moe_grouped(*(a.to(DEV) for a in (x, w13, s13, w2, s2)), block, weights.to(dtype).to(DEV),
                          ids.to(DEV), tiles=moe_tiles(tiles), align=align)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_fp8_grouped_moe_refuses_scale_blocks_it_cannot_tile():
    from lamina.kernels.triton_fp8_moe_gemm import fp8_moe_grouped, grouped_block_ok

    assert grouped_block_ok(None) and grouped_block_ok((128, 128)) and not grouped_block_ok((128, 96))
    x = torch.zeros(2, 96, device=DEV)
    with pytest.raises(ValueError, match="power-of-two"):
        fp8_moe_grouped(x, None, None, None, None, (16, 8), None, None)


def test_fp8_grouped_moe_no_tokens():
    from lamina.kernels.triton_fp8_moe_gemm import fp8_moe_grouped

    gen = torch.Generator().manual_seed(3)
    w13, s13, w2, s2 = (a.to(DEV) for a in fp8_stacks(4, 32, 16, None, gen))
    x = torch.zeros(0, 32, device=DEV, dtype=torch.float16)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEV)
    out = fp8_moe_grouped(x, w13, s13, w2, s2, None, torch.zeros(0, 2, device=DEV, dtype=x.dtype), ids)
    assert out.shape == (0, 32)


def wq_stacks(e, h, i, bits, group, act_order, gen):
    """Random grouped-integer stacks in lamina's layout (uint8 pairs / int8, fp16 scale and offset per
    group) and, with act_order, a random column order per expert; plus the dequantized weights in the
    original column order (the oracle's)."""
    out, dense = [], []
    for n, k in ((2 * i, h), (h, i)):
        if bits == 4:
            q = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
        else:
            q = torch.randint(-128, 128, (e, n, k), generator=gen, dtype=torch.int8)
        span = 15.0 if bits == 4 else 255.0
        s = (torch.rand(e, n, k // group, generator=gen) * 2 / (span * k ** 0.5) + 1e-3).half()
        o = (torch.randn(e, n, k // group, generator=gen) * 0.02).half()
        perm = torch.stack([torch.randperm(k, generator=gen) for _ in range(e)]).int() if act_order else None
        stored = torch.stack([wq_dequantize(q[j], s[j], o[j], bits) for j in range(e)])  # columns in stored order
        if perm is not None:  # stored column c multiplies input column perm[c]
            orig = torch.empty_like(stored)
            for j in range(e):
                orig[j][:, perm[j].long()] = stored[j]
            stored = orig
        out += [q, s, o, perm]
        dense.append(stored.double())
    return out, dense


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 16), (8, 16), (4, 8)], ids=["int4g32", "int4g16", "int8g16",
                                                                              "int4g8_per_element"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_wq_grouped_moe_matches_the_dequantized_reference(case, bits, group, dtype):
    from lamina.kernels.triton_wq_moe import wq_moe_grouped

    t, e, k, h, i, experts, skew, tiles, align = CASES[case]
    if h % group or i % group:
        pytest.skip("the group size must divide H and I")
    gen = torch.Generator().manual_seed(len(case) * 5 + bits + group)
    act_order = case.startswith(("empty", "ragged"))
    (q13, s13, o13, p13, q2, s2, o2, p2), (w13, w2) = wq_stacks(e, h, i, bits, group, act_order, gen)
    weights, ids = routing(t, e, k, gen, experts, skew)
    x = torch.randn(t, h, generator=gen).to(dtype)
    ref = fused_moe_ref(x.double(), w13, w2, weights.double(), ids)
    dev = [None if a is None else a.to(DEV) for a in (q13, s13, o13, p13, q2, s2, o2, p2)]
    out = wq_moe_grouped(x.to(DEV), *dev, bits, weights.to(dtype).to(DEV), ids.to(DEV), tiles=moe_tiles(tiles),
                         align=align)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "act-order"])
def test_gptq_expert_layer_through_the_grouped_kernel(act_order, monkeypatch):
    """A GPTQ expert stack loaded as a checkpoint would be (expert by expert, gate, up, down), its repacked
    stacks and act-order permutations fed to the grouped kernel exactly as GPTQExperts.apply does on CUDA,
    against the dense MoE reference on the weights the GPTQ integers define."""
    from int4_checkpoints import dense_weight, gptq_tensors, random_quant

    from lamina.kernels.triton_wq_moe import wq_moe_grouped
    from lamina.models.layers.moe import FusedExperts
    from lamina.models.weight_formats.int4_experts import _PROJ, GPTQExperts

    e, h, i = 4, 64, 32
    with torch.device("meta"):
        layer = FusedExperts(e, h, i, fmt=GPTQExperts(4, 32))
    layer = layer.to_empty(device="cpu")
    w13, w2 = [], []
    for x in range(e):
        dense, g_idx = {}, {}
        for shard, (n, k) in (("gate", (i, h)), ("up", (i, h)), (None, (h, i))):
            q, z, s, g = random_quant(n, k, 32, seed=10 * x + len(dense), act_order=act_order)
            g = g_idx.setdefault(k if shard else "down", g)
            proj = "down_proj" if shard is None else "gate_up_proj"
            for name, t in gptq_tensors(q, z, s, g).items():
                layer.weight_loaders[f"{proj}_{name}"].loader(layer, getattr(layer, f"{proj}_{name}"), t, shard, x)
            dense[shard] = dense_weight(q, z, s, g)
        w13.append(torch.cat([dense["gate"], dense["up"]]))
        w2.append(dense[None])
    layer.format.finish_loading(layer)
    assert (layer.__dict__["_gate_up_proj_perm_stack"] is not None) == act_order
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(19, h, generator=gen).half()
    weights, ids = routing(19, e, 2, gen, skew=True)
    want = fused_moe_ref(x.double(), torch.stack(w13).double(), torch.stack(w2).double(), weights.double(), ids)
    stacks = [None if t is None else t.to(DEV) for p in _PROJ
              for t in (getattr(layer, p), getattr(layer, f"{p}_scales"), getattr(layer, f"{p}_offsets"),
                        layer.__dict__[f"_{p}_perm_stack"])]
    got = wq_moe_grouped(x.to(DEV), *stacks, 4, weights.half().to(DEV), ids.to(DEV))
    assert rel_err(got, want) < TOL[torch.float16]
    if DEV.type == "cpu":  # and through GPTQExperts.apply as CUDA dispatches it (use_triton forced on)
        import lamina.models.weight_formats.int4_experts as experts_mod

        monkeypatch.setattr(experts_mod, "use_triton", lambda t: True)
        monkeypatch.setattr(experts_mod.GPTQExperts, "_linear", None)  # the per-expert loop must not run
        assert rel_err(layer(x, weights.half(), ids), want) < TOL[torch.float16]


@pytest.mark.parametrize("tokens", [3, 40], ids=["decode_gemv", "prefill_grouped"])
def test_fp8_fused_moe_dispatch(monkeypatch, tokens):
    """kernels.fp8.fp8_fused_moe as the GPU takes it (use_triton forced on; the interpreter runs the kernels
    on CPU tensors): <= 64 pairs take the decode GEMVs, more the grouped GEMMs, never the dequantized stacks."""
    import lamina.kernels.fp8 as fp8mod
    import lamina.kernels.triton_fp8_moe_gemm as grouped

    calls = []
    real = grouped.fp8_moe_grouped
    monkeypatch.setattr(fp8mod, "use_triton", lambda t: True)
    monkeypatch.setattr(grouped, "fp8_moe_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(fp8mod, "dequantize", None)  # the old prefill path would call it
    gen = torch.Generator().manual_seed(tokens)
    block = (16, 32)
    w13, s13, w2, s2 = fp8_stacks(8, 64, 32, block, gen)
    weights, ids = routing(tokens, 8, 2, gen)
    x = torch.randn(tokens, 64, generator=gen).half()
    want = fused_moe_ref(x.double(), dequantize(w13, s13, block).double(), dequantize(w2, s2, block).double(),
                         weights.double(), ids)
    got = fp8mod.fp8_fused_moe(x.to(DEV), w13.to(DEV), s13.to(DEV), w2.to(DEV), s2.to(DEV), block,
                               weights.half().to(DEV), ids.to(DEV))
    assert len(calls) == int(tokens * 2 > 64)
    assert rel_err(got, want) < TOL[torch.float16]
