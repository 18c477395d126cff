"""Weight formats and the checkpoint router: fused shards, expert stacks, tensor-parallel slices, tied
embeddings, errors for missing or wrong-shaped tensors, and a format plugged in without touching a layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from lamina.kernels.moe import fused_moe_ref
from lamina.models.layers.linear import Embedding, Linear
from lamina.models.layers.moe import FusedExperts
from lamina.models.loader import build_model, read_config, resolve_source
from lamina.models.weight_formats import DenseFormat, Partition, WeightFormat, weight_loader
from lamina.models.weight_formats.base import copy_checked, new_param, register_param
from lamina.models.weights import load_weights

pytestmark = pytest.mark.usefixtures("one_thread")
SHARDS = {"q": 8, "k": 4, "v": 4}


def materialized(layer: torch.nn.Module) -> torch.nn.Module:
    return layer.to_empty(device="cpu")


def fused_linear(fmt=None) -> Linear:
    with torch.device("meta"):
        return materialized(Linear(6, SHARDS, bias=True, fmt=fmt))


def parts(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, 6, generator=g), torch.randn(s, generator=g)) for n, s in SHARDS.items()}


def load_parts(layer: Linear, ps) -> None:
    for name, (w, b) in ps.items():
        weight_loader(layer, "weight")(layer.weight, w, shard=name)
        weight_loader(layer, "bias")(layer.bias, b, shard=name)


def test_fused_shards_load_by_name():
    layer, ps = fused_linear(), parts()
    load_parts(layer, dict(reversed(ps.items())))  # the order the checkpoint lists them in does not matter
    x = torch.randn(3, 6)
    ref = torch.cat([F.linear(x, w, b) for w, b in ps.values()], dim=-1)
    assert torch.equal(layer.weight, torch.cat([w for w, _ in ps.values()]))  # the layout, exactly
    # The products only closely: BLAS picks its kernel by the output width, which differs between the fused
    # matmul and its parts (CI's CPU gave 4.8e-7 apart).
    torch.testing.assert_close(layer(x), ref)
    # A checkpoint that already holds the fused tensor loads it whole.
    whole = fused_linear()
    weight_loader(whole, "weight")(whole.weight, torch.cat([w for w, _ in ps.values()]))
    assert torch.equal(whole.weight, layer.weight)


def test_loader_refuses_wrong_shapes_and_names():
    layer, ps = fused_linear(), parts()
    with pytest.raises(ValueError, match=r"shard 'k' of the weight expects shape \(4, 6\).*\(5, 6\)"):
        weight_loader(layer, "weight")(layer.weight, torch.randn(5, 6), shard="k")
    with pytest.raises(ValueError, match="no shard 'gate'.*q, k, v"):
        weight_loader(layer, "weight")(layer.weight, ps["q"][0], shard="gate")
    with pytest.raises(ValueError, match="not an expert stack"):
        weight_loader(layer, "weight")(layer.weight, ps["q"][0], shard="q", expert=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_apply_is_f_linear_in_each_dtype(dtype):
    with torch.device("meta"):
        layer = Linear(6, 5, bias=False)
    layer = materialized(layer.to(dtype))
    w = torch.randn(5, 6)
    weight_loader(layer, "weight")(layer.weight, w)  # cast on the way in
    assert layer.weight.dtype == dtype and layer.bias is None
    x = torch.randn(2, 6, dtype=dtype)
    assert torch.equal(layer(x), F.linear(x, w.to(dtype)))


def test_expert_stack_loads_per_expert_and_shard():
    e, h, i = 3, 4, 2
    with torch.device("meta"):
        experts = FusedExperts(e, h, i)
    experts = materialized(experts)
    g = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g),
                      torch.randn(e, h, i, generator=g))
    gate_up, down_ld = weight_loader(experts, "gate_up_proj"), weight_loader(experts, "down_proj")
    for k in reversed(range(e)):
        gate_up(experts.gate_up_proj, up[k], shard="up", expert=k)
        gate_up(experts.gate_up_proj, gate[k], shard="gate", expert=k)
        down_ld(experts.down_proj, down[k], expert=k)
    w13 = torch.cat([gate, up], dim=1)
    assert torch.equal(experts.gate_up_proj, w13) and torch.equal(experts.down_proj, down)
    x = torch.randn(5, h)
    weights, ids = torch.rand(5, 2), torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    torch.testing.assert_close(experts(x, weights, ids), fused_moe_ref(x, w13, down, weights, ids))
    with pytest.raises(ValueError, match="expert 3 is out of range"):
        gate_up(experts.gate_up_proj, gate[0], shard="gate", expert=3)
    with pytest.raises(ValueError, match="expert 1's up expects shape"):
        gate_up(experts.gate_up_proj, gate[0].T, shard="up", expert=1)


def test_column_parallel_shards_split_each_fused_part():
    ps, x = parts(), torch.randn(3, 6)
    full = fused_linear()
    load_parts(full, ps)
    ref = full(x).split(list(SHARDS.values()), dim=-1)
    for rank in range(2):
        layer = fused_linear(DenseFormat(Partition(rank, 2, dim=0)))
        assert layer.weight.shape == (8, 6) and layer.bias.shape == (8,)
        load_parts(layer, ps)  # full checkpoint tensors in; each rank keeps its half of q, of k, of v
        want = torch.cat([r.chunk(2, dim=-1)[rank] for r in ref], dim=-1)
        assert torch.equal(layer.weight, torch.cat([w.chunk(2)[rank] for w, _ in ps.values()]))  # exactly
        torch.testing.assert_close(layer(x), want)  # products closely: BLAS kernels differ by output width
        whole = fused_linear(DenseFormat(Partition(rank, 2, dim=0)))
        weight_loader(whole, "weight")(whole.weight, full.weight.detach())  # a whole fused tensor splits too
        assert torch.equal(whole.weight, layer.weight)


def test_row_parallel_partial_sums_add_up():
    g = torch.Generator().manual_seed(2)
    w, b, x = torch.randn(5, 8, generator=g), torch.randn(5, generator=g), torch.randn(3, 8, generator=g)
    total = torch.zeros(3, 5)
    for rank in range(2):
        with torch.device("meta"):
            layer = Linear(8, 5, bias=True, fmt=DenseFormat(Partition(rank, 2, dim=1)))
        layer = materialized(layer)
        assert layer.weight.shape == (5, 4)
        weight_loader(layer, "weight")(layer.weight, w)
        weight_loader(layer, "bias")(layer.bias, b)
        total += layer(x[:, rank * 4:(rank + 1) * 4])  # what the all-reduce would sum
    torch.testing.assert_close(total, F.linear(x, w, b))
    with pytest.raises(ValueError, match="does not split over 2 ranks"):
        Linear(7, 5, fmt=DenseFormat(Partition(0, 2, dim=1)), dtype=torch.float32)


def _llama(checkpoints):
    source = resolve_source(str(checkpoints["llama"]))
    cfg, _ = read_config(source)
    return cfg, load_file(str(source.path / "model.safetensors"))


def test_missing_tensor_names_the_part(checkpoints):
    cfg, tensors = _llama(checkpoints)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"missing 1 tensors.*model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        load_weights(model, tensors.items())


def test_wrong_shape_names_the_checkpoint_tensor(checkpoints):
    cfg, tensors = _llama(checkpoints)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' -> "
                                         r"model\.layers\.0\.mlp\.gate_up_proj\.weight\[up\]: shard 'up'"):
        load_weights(model, tensors.items())
    tensors = _llama(checkpoints)[1]
    tensors["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*expects shape \(64,\)"):
        load_weights(build_model(cfg, torch.float32, torch.device("cpu")), tensors.items())
    tensors = _llama(checkpoints)[1]
    tensors["model.layers.0.self_attn.extra.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="has no place in the model"):
        load_weights(build_model(cfg, torch.float32, torch.device("cpu")), tensors.items())


def test_tied_embeddings_share_one_parameter(checkpoints):
    source = resolve_source(str(checkpoints["qwen2"]))
    cfg, _ = read_config(source)
    assert cfg.tie_word_embeddings
    tensors = load_file(str(source.path / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    model = build_model(cfg, torch.bfloat16, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # A tied checkpoint may carry a copy of lm_head: it is skipped, the embedding is what both read.
    load_weights(model, [*tensors.items(), ("lm_head.weight", torch.zeros_like(tensors["model.embed_tokens.weight"]))])
    emb = tensors["model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(model.model.embed_tokens.weight, emb) and model.lm_head.weight is model.model.embed_tokens.weight
    x = torch.randn(2, cfg.hidden_size, dtype=torch.bfloat16)
    assert torch.equal(model.compute_logits(x), F.linear(x, emb).float())
    assert torch.equal(model.model.embed_tokens(torch.tensor([3, 1])), emb[[3, 1]])
    with torch.device("meta"):
        head, table = Linear(4, 10), Embedding(11, 4)
    with pytest.raises(ValueError, match="cannot tie"):
        head.tie_to(table)


class Int8Rows(WeightFormat):
    """A test-only format: int8 weights with a per-row fp32 scale, quantized as the checkpoint streams in
    (the shape of an online-quantized or a quantized-checkpoint format), dense bias."""

    def create_params(self, layer, in_features, out_shards, bias, dtype):
        out = sum(out_shards.values())
        register_param(layer, "weight", new_param((out, in_features), torch.int8), self._load,
                       tuple(n for n in out_shards if n))
        layer.register_buffer("weight_scale", torch.empty(out, dtype=torch.float32))
        if bias:
            register_param(layer, "bias", new_param((out,), dtype), self._load_bias, tuple(n for n in out_shards if n))
        else:
            layer.register_parameter("bias", None)

    @staticmethod
    def _rows(layer, shard):
        if shard is None:
            return slice(None)
        start = 0
        for name, size in layer.out_shards.items():
            if name == shard:
                return slice(start, start + size)
            start += size
        raise ValueError(f"no shard {shard!r}")

    def _load(self, layer, param, tensor, shard=None, expert=None):
        rows = self._rows(layer, shard)
        t = tensor.float()
        scale = t.abs().amax(dim=1).clamp(min=1e-8) / 127
        copy_checked(param[rows], torch.round(t / scale[:, None]).to(torch.int8), f"shard {shard}")
        layer.weight_scale[rows] = scale

    def _load_bias(self, layer, param, tensor, shard=None, expert=None):
        copy_checked(param[self._rows(layer, shard)], tensor, f"bias shard {shard}")

    def apply(self, layer, x):
        w = (layer.weight.float() * layer.weight_scale[:, None]).to(x.dtype)
        return F.linear(x, w, layer.bias)


def test_a_new_format_plugs_in_without_touching_the_layers(checkpoints):
    """Every projection of the decoder layers switched to the test-only int8 format by name: the same
    checkpoint loads through its loaders (fused q|k|v and gate|up shards included) and each projection
    computes what the dense one does, within int8 rounding."""
    cfg, tensors = _llama(checkpoints)
    dense = build_model(cfg, torch.float32, torch.device("cpu"))
    load_weights(dense, tensors.items())
    def choose(name: str, layer: torch.nn.Module) -> Int8Rows | None:
        return Int8Rows() if name.startswith("model.layers.") else None

    quant = build_model(cfg, torch.float32, torch.device("cpu"), choose_format=choose)
    load_weights(quant, tensors.items())
    layers = {n: m for n, m in quant.named_modules() if isinstance(m, Linear)}
    switched = [n for n, m in layers.items() if isinstance(m.format, Int8Rows)]
    assert len(switched) == 4 * cfg.num_layers and "lm_head" not in switched
    dense_layers = dict(dense.named_modules())
    for name in switched:
        q, d = layers[name], dense_layers[name]
        assert q.weight.dtype == torch.int8 and q.weight.shape == d.weight.shape
        x = torch.randn(4, q.in_features)
        ref = d(x)
        assert ((q(x) - ref).abs().max() / ref.abs().max()).item() < 0.02, name
