"""Tensor parallelism with quantized weights on the CPU: two gloo processes on the same quantized checkpoint
must produce what one process produces (greedy tokens identical, logprobs within 1e-4, fp32 compute).

Each format cuts its own tensors (lamina/parallel/tp_quant.py); the oracle is the same engine at TP=1 on the
same checkpoint (itself checked against HF transformers by the format's own tests). Every TP=2 engine costs a
worker start, so each test builds one and the prompts are those of test_tensor_parallel.py.
"""
from __future__ import annotations

import json

import pytest
import torch
from fp8_checkpoints import block_quantizer, write_quantized
from tp_helpers import KW, assert_same, tp_pair

from lamina import LLM, SamplingParams
from lamina.models.weight_formats.base import Cut
from lamina.parallel.tp_quant import QuantParallel, QuantTPExperts

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}


def _formats(llm: LLM, kind) -> dict[str, object]:
    return {n: m.format for n, m in llm.engine.model.named_modules() if isinstance(getattr(m, "format", None), kind)}


def _run(path, **extra):
    one, two, llm = tp_pair(path, **extra)
    try:
        assert_same(one, two)
        return _formats(llm, (QuantParallel, QuantTPExperts))
    finally:
        llm.engine.close()


def test_fp8_block_tp2_matches_tp1(checkpoints, tmp_path):
    qdir, _ = write_quantized(checkpoints["qwen3"], tmp_path, block_quantizer((16, 16)), BLOCK)
    split = _run(qdir)
    assert {type(f.inner).__name__ for f in split.values()} == {"Fp8Linear"}
    assert any(f.partition.dim == 1 for f in split.values()) and any(f.partition.dim == 0 for f in split.values())


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory, smol_tokenizer):
    from hybrid_helpers import make_hybrid_checkpoint

    return make_hybrid_checkpoint(tmp_path_factory.mktemp("tpq") / "qwen3_moe", "qwen3_moe", smol_tokenizer, seed=6)


def test_compressed_tensors_fp8_channel_tp2_matches_tp1(checkpoints, tmp_path):
    """qwen2 (q/k/v biases split by column, tied vocab-parallel embedding), per-channel scales cut with rows."""
    from compressed_tensors.quantization import QuantizationScheme
    from fp8_checkpoints import ct_quantizer
    from test_compressed_tensors import DYNAMIC, ct_config

    cfg = ct_config({"strategy": "channel"}, DYNAMIC)
    qdir, _ = write_quantized(checkpoints["qwen2"], tmp_path, ct_quantizer(QuantizationScheme(
        **cfg["config_groups"]["group_0"])), cfg)
    split = _run(qdir)
    assert {type(f.inner).__name__ for f in split.values()} == {"Fp8Linear"}


def test_fp8_experts_per_tensor_static_tp2_matches_tp1(moe_checkpoint, tmp_path):
    """compressed-tensors per-tensor FP8 with static input scales, the MoE experts under QuantTPExperts."""
    from compressed_tensors.quantization import QuantizationScheme
    from fp8_checkpoints import ct_quantizer
    from test_compressed_tensors import STATIC, ct_config

    cfg = ct_config({"strategy": "tensor"}, STATIC, ignore=["lm_head", "re:.*mlp\\.gate$"])
    qdir, _ = write_quantized(moe_checkpoint, tmp_path, ct_quantizer(QuantizationScheme(
        **cfg["config_groups"]["group_0"])), cfg)
    split = _run(qdir)
    experts = [f for f in split.values() if isinstance(f, QuantTPExperts)]
    assert experts and {type(f.inner).__name__ for f in experts} == {"Fp8Experts"}


def test_online_fp8_tp2_matches_tp1(moe_checkpoint):
    """--quantization fp8: row-parallel pieces are quantized over their full rows, so every rank's weights
    dequantize exactly as one process's (a rank-local row scale would not)."""
    split = _run(moe_checkpoint, quantization="fp8")
    assert any(isinstance(f, QuantTPExperts) for f in split.values())
    assert any(isinstance(f, QuantParallel) and f.partition.dim == 1 for f in split.values())


def test_gptq_act_order_tp2_matches_tp1(checkpoints, tmp_path_factory):
    """GPTQ v1, act-order, group 32: the column-parallel layers cut qweight/qzeros/scales by output features;
    the row-parallel ones (o_proj, down_proj) gather their input instead of splitting K."""
    from test_int4_model import gptq_pair

    qdir, _ = gptq_pair.__wrapped__(checkpoints, tmp_path_factory)
    split = _run(qdir)
    o_proj = split["model.layers.0.self_attn.o_proj"]
    assert type(o_proj.inner).__name__ == "GPTQFormat" and o_proj.gathers_input


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_packed_tp2_matches_tp1(tmp_path, qtype, monkeypatch):
    """A llama GGUF kept packed (every projection and the tied embedding in GGUF blocks): rows split whole,
    K split in whole 32-element blocks; the tied lm_head reads the vocab-parallel packed table. The CPU's
    packed matmuls take bf16 activations and return bf16 partial sums, which is not the fp32 compute this
    oracle needs: both runs (and the worker, which inherits the environment) use the fp32 reference."""
    from gguf import GGMLQuantizationType as T
    from gguf_checkpoints import write_tiny_llama_gguf

    monkeypatch.setenv("LAMINA_CPU_QUANT_FORMS", "0")

    path = write_tiny_llama_gguf(tmp_path / f"tiny-{qtype}.gguf", T[qtype])
    split = _run(path, skip_tokenizer_init=True)
    assert {type(f.inner).__name__ for f in split.values()} == {"GGUFFormat"}
    assert {"model.embed_tokens", "lm_head", "model.layers.1.mlp.down_proj"} <= set(split)


def test_gptq_in_order_splits_k_by_groups(checkpoints, tmp_path, monkeypatch):
    """GPTQ without act order (g_idx = k // 32): the row-parallel layers cut qweight by K/8 rows and qzeros /
    scales / g_idx by whole groups (fp32 reference matmuls: see the GGUF test)."""
    import shutil

    from int4_checkpoints import gptq_tensors
    from safetensors.torch import load_file, save_file
    from test_int4_model import GROUP, PROJ, QUANT, rtn

    monkeypatch.setenv("LAMINA_CPU_QUANT_FORMS", "0")
    src, qdir = checkpoints["llama"], tmp_path / "gptq"
    shutil.copytree(src, qdir)
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name.split(".")[-2] in PROJ:
            g_idx = (torch.arange(w.shape[1]) // GROUP).int()
            q, z, s = rtn(w.float(), g_idx)
            out.update({f"{name.removesuffix('.weight')}.{t}": v for t, v in gptq_tensors(q, z, s, g_idx).items()})
        else:
            out[name] = w
    save_file({k: v.clone().contiguous() for k, v in out.items()}, str(qdir / "model.safetensors"))
    cfg = json.loads((qdir / "config.json").read_text())
    (qdir / "config.json").write_text(json.dumps({**cfg, "quantization_config": {**QUANT, "desc_act": False}}))
    split = _run(qdir)
    down = split["model.layers.0.mlp.down_proj"]
    assert type(down.inner).__name__ == "GPTQFormat" and down.partition.dim == 1 and not down.gathers_input


def test_misaligned_block_split_is_refused_in_one_line(checkpoints, tmp_path):
    """FP8 blocks of 64 over 64-row k/v shards: each rank would hold half a block of scale rows."""
    cfg = dict(BLOCK, weight_block_size=[64, 64])
    qdir, _ = write_quantized(checkpoints["qwen3"], tmp_path, block_quantizer((64, 64)), cfg)
    with pytest.raises(ValueError) as e:
        LLM(str(qdir), tensor_parallel_size=2, **KW)
    msg = str(e.value)
    assert "\n" not in msg and "--tensor-parallel-size 2: model.layers.0.self_attn.qkv_proj" in msg, msg
    assert "FP8 block size 64 does not divide the rows of fused shards (k: 32, v: 32)" in msg, msg


# -- format level: each rank's piece dequantizes to its slice of the whole weight --------------------------

def _loaded(fmt, k: int, shards: dict[str, int], tensors: dict[str, dict[str, torch.Tensor]]):
    """A Linear in `fmt` with tensors[shard][param] loaded (then finish_loading), on the CPU."""
    from lamina.models.layers.linear import Linear

    with torch.device("meta"):
        layer = Linear(k, shards, fmt=fmt)
    layer = layer.to_empty(device="cpu")
    for shard, params in tensors.items():
        for name, t in params.items():
            layer.weight_loaders[name].loader(layer, getattr(layer, name), t, shard or None)
    finish = getattr(layer.format, "finish_loading", None)
    if finish is not None:
        finish(layer)
    return layer


def _check_pieces(make, k: int, shards: dict[str, int], tensors, dense: torch.Tensor) -> None:
    from lamina.parallel.context import ParallelContext

    whole = _loaded(make(), k, shards, tensors)
    got = whole.format.dequantized(whole, torch.float32)
    torch.testing.assert_close(got, dense, rtol=0, atol=dense.abs().max().item() * 2e-3)  # fp16 scales/offsets
    dense = got  # exact from here: each piece against the same weight loaded whole
    offsets = dict(zip(shards, torch.tensor([0, *shards.values()]).cumsum(0).tolist()))
    for rank in range(2):
        ctx = ParallelContext(rank, 2)
        col = _loaded(QuantParallel(make(), ctx, 0), k, shards, tensors)
        want = torch.cat([dense[offsets[s] + rank * n // 2: offsets[s] + (rank + 1) * n // 2]
                          for s, n in shards.items()])
        torch.testing.assert_close(col.format.dequantized(col, torch.float32), want, rtol=0, atol=1e-6)
        row = _loaded(QuantParallel(make(), ctx, 1), k, shards, tensors)
        if row.format.gathers_input:
            continue
        want = dense[:, rank * k // 2:(rank + 1) * k // 2]
        torch.testing.assert_close(row.format.dequantized(row, torch.float32), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "Q4_1"])
def test_gguf_blocks_cut_by_rows_and_whole_blocks(qtype):
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gguf_dequantize
    from test_gguf_blocks import _random_blocks

    from lamina.models.weight_formats.gguf_format import GGUFFormat

    t, k, shards = T[qtype], 512, {"gate": 32, "up": 32}
    raws = {s: _random_blocks(t, n, k, seed=i) for i, (s, n) in enumerate(shards.items())}
    dense = torch.cat([torch.from_numpy(gguf_dequantize(r, t).reshape(shards[s], k)) for s, r in raws.items()])
    tensors = {s: {"weight": torch.from_numpy(r)} for s, r in raws.items()}
    make = lambda: GGUFFormat({s: t for s in shards})  # noqa: E731
    _check_pieces(make, k, shards, tensors, dense)


def test_gguf_super_block_split_is_refused():
    """Q4_K super-blocks are 256 features: a 256-wide K over two ranks would cut one in half."""
    from gguf import GGMLQuantizationType as T
    from test_gguf_blocks import _random_blocks

    from lamina.models.weight_formats.gguf_format import GGUFFormat
    from lamina.parallel.context import ParallelContext

    raw = torch.from_numpy(_random_blocks(T.Q4_K, 32, 256, seed=0))
    with pytest.raises(ValueError, match=r"input features \[0, 128\) of 256 do not fall on its blocks of 256"):
        _loaded(QuantParallel(GGUFFormat({"": T.Q4_K}), ParallelContext(0, 2), 1), 256, {"": 32}, {"": {"weight": raw}})


@pytest.mark.parametrize("kind", ["gptq", "gptq-act-order", "awq", "ct-asym", "ct-act-order"])
def test_int4_pieces_dequantize_to_their_slices(kind):
    from int4_checkpoints import awq_tensors, ct_tensors, dense_weight, gptq_tensors, random_quant

    from lamina.models.weight_formats.int4_ct import CTInt4Format
    from lamina.models.weight_formats.int4_gptq import AWQFormat, GPTQFormat

    k, group, shards = 128, 32, {"q": 32, "k": 16, "v": 16}
    act = kind.endswith("act-order")
    order = random_quant(8, k, group, seed=9, act_order=act)[3]  # one activation order shared by the parts
    tensors, dense = {}, []
    for i, (s, n) in enumerate(shards.items()):
        q, z, sc, _ = random_quant(n, k, group, seed=i)
        if kind.startswith("gptq"):
            tensors[s] = gptq_tensors(q, z, sc, order)
        elif kind == "awq":
            tensors[s] = awq_tensors(q, z, sc)
        else:
            tensors[s] = ct_tensors(q, z, sc, order if act else None, sym=False)
        dense.append(dense_weight(q, z, sc, order))
    make = {"gptq": lambda: GPTQFormat(4, group), "gptq-act-order": lambda: GPTQFormat(4, group, desc_act=True),
            "awq": lambda: AWQFormat(4, group), "ct-asym": lambda: CTInt4Format(group, False, False),
            "ct-act-order": lambda: CTInt4Format(group, False, True)}[kind]
    _check_pieces(make, k, shards, tensors, torch.cat(dense))


def test_cut_refuses_a_split_block_and_a_wrong_shape():
    cut = Cut(1, 48, 48, 96)
    with pytest.raises(ValueError, match="blocks of 32"):
        cut.along(torch.zeros(4, 3), 1, 32, what="w")
    assert Cut(0, 64, 64, 128).along(torch.zeros(2, 5), 0, 64, 1).shape == (1, 5)
    assert Cut(0, 64, 40, 104).along(torch.zeros(2, 5), 0, 64).shape == (1, 5)  # a last partial block
    with pytest.raises(ValueError, match="expects 2 entries"):
        Cut(0, 0, 64, 128).along(torch.zeros(3, 5), 0, 64)


def test_fp8_kv_cache_with_checkpoint_scales_tp2_matches_tp1(checkpoints, tmp_path):
    """--kv-cache-dtype fp8 with the checkpoint's k_scale / v_scale: every rank's layers get the scales (one
    per layer, the same for each rank's KV heads) and its pool holds its KV heads in FP8."""
    from test_fp8_kv_cache import with_kv_scales

    path = with_kv_scales(checkpoints["llama"], tmp_path / "llama", 0.25, 0.125, "ct")
    one, two, llm = tp_pair(path, kv_cache_dtype="fp8")
    try:
        assert_same(one, two)
        layers = [m for m in llm.engine.model.modules() if hasattr(m, "set_kv_scales")]
        assert [m.kv_scales for m in layers] == [(0.25, 0.125)] * 2
        assert llm.engine.kv_cache.views[0].k.dtype == torch.float8_e4m3fn
    finally:
        llm.engine.close()


@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "act-order"])
def test_gptq_experts_pieces_sum_to_the_whole(act_order):
    """GPTQ expert stacks split along the intermediate dim: the ranks' partial MoE outputs sum to one
    process's; an act-order down projection (its K is the intermediate dim) is refused in one line."""
    from int4_checkpoints import gptq_tensors, random_quant

    from lamina.models.layers.moe import FusedExperts
    from lamina.models.weight_formats.int4_experts import GPTQExperts
    from lamina.parallel.context import ParallelContext

    e, h, i, group = 2, 64, 64, 32
    tensors = []
    for x in range(e):
        order = {}
        for shard, (n, k) in (("gate", (i, h)), ("up", (i, h)), (None, (h, i))):
            q, z, s, g = random_quant(n, k, group, seed=10 * x + len(order), act_order=act_order)
            g = order.setdefault(k if shard else "down", g)
            proj = "down_proj" if shard is None else "gate_up_proj"
            tensors += [(f"{proj}_{name}", t, shard, x) for name, t in gptq_tensors(q, z, s, g).items()]

    def build(fmt):
        with torch.device("meta"):
            layer = FusedExperts(e, h, i, fmt=fmt)
        layer = layer.to_empty(device="cpu")
        for name, t, shard, x in tensors:
            layer.weight_loaders[name].loader(layer, getattr(layer, name), t, shard, x)
        layer.format.finish_loading(layer)
        return layer

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    want = build(GPTQExperts(4, group))(x, weights, ids)
    if act_order:
        with pytest.raises(ValueError, match="act-order .* cannot be split"):
            build(QuantTPExperts(GPTQExperts(4, group), ParallelContext(0, 2)))
        return
    got = sum(layer.format.inner.apply(layer, x, weights, ids) for layer in
              (build(QuantTPExperts(GPTQExperts(4, group), ParallelContext(r, 2))) for r in range(2)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_quantized_vocab_parallel_embedding_and_tied_lm_head():
    """A GGUF Q8_0 embedding table split by rows: each rank looks up its rows (zeros elsewhere) and the ranks'
    sum is the whole table's lookup; a tied lm_head reads the same local rows."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType as T
    from test_gguf_blocks import _random_blocks

    from lamina.models.layers.linear import Embedding, Linear
    from lamina.models.weight_formats.gguf_format import GGUFFormat

    vocab, dim = 64, 64
    raw = torch.from_numpy(_random_blocks(T.Q8_0, vocab, dim, seed=3))
    ids = torch.tensor([0, 5, 31, 32, 63, 40])

    def table(fmt):
        with torch.device("meta"):
            emb = Embedding(vocab, dim, fmt=fmt)
        emb = emb.to_empty(device="cpu")
        emb.weight_loaders["weight"].loader(emb, emb.weight, raw, None)
        return emb

    want = table(GGUFFormat({"": T.Q8_0}))(ids)
    pieces = []
    for rank in range(2):
        ctx = SimpleNamespace(rank=rank, world=2, all_reduce=lambda x: x, gather_last=lambda x: x)
        emb = table(QuantParallel(GGUFFormat({"": T.Q8_0}), ctx, 0))
        pieces.append(emb(ids))
        with torch.device("meta"):
            head = Linear(dim, vocab, fmt=QuantParallel(GGUFFormat({"": T.Q8_0}), ctx, 0, gather=True))
        head = head.to_empty(device="cpu")
        head.tie_to(emb)
        assert head.weight is emb.weight and head.weight.shape[0] == vocab // 2
    torch.testing.assert_close(pieces[0] + pieces[1], want, rtol=0, atol=0)


def test_random_preset_quantized_online_under_tp():
    """Benchmark presets draw their weights at each rank's local shape (no cut) and quantize them there."""
    llm = LLM("random:tiny-llama", tensor_parallel_size=2, quantization="fp8", **KW)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 3
        assert _formats(llm, QuantParallel)
    finally:
        llm.engine.close()
