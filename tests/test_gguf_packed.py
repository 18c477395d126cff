"""GGUF weights kept packed: a fused layer whose parts have different block types (every supported type)
against gguf's own dequantization, and the built-in SmolLM2 (Q4_1 layers, a Q8_0 tied embedding) from
packed weights against the same model dequantized to fp32 (the oracle: its logprobs and greedy tokens)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from test_gguf_blocks import _random_blocks

from lamina import LLM, SamplingParams
from lamina.models.layers.linear import Linear
from lamina.models.weight_formats.gguf_format import GGUFFormat, layout_for

TEXT = ("ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.")


@pytest.mark.parametrize("types", [{"q": T.Q4_K, "k": T.Q4_0, "v": T.Q4_1},
                                   {"q": T.Q6_K, "k": T.Q5_K, "v": T.Q8_0}, {"q": T.Q4_K, "k": T.Q6_K, "v": T.Q4_1}],
                         ids=["int4", "int8", "mixed"])
def test_fused_layer_of_mixed_types(types):
    k, sizes = 256, {"q": 32, "k": 16, "v": 16}
    with torch.device("meta"):
        layer = Linear(k, sizes, fmt=GGUFFormat(types))
    layer = layer.to_empty(device="cpu")
    ref = []
    for i, (shard, qtype) in enumerate(types.items()):
        raw = _random_blocks(qtype, sizes[shard], k, seed=i)
        layer.weight_loaders["weight"].loader(layer, layer.weight, torch.from_numpy(raw), shard)
        ref.append(gguf_dequantize(raw, qtype).reshape(sizes[shard], k))
    ref = torch.from_numpy(np.concatenate(ref))
    assert (layer.format.bits, layer.format.group) == layout_for(types)
    w = layer.format.dequantized(layer, torch.float32)
    torch.testing.assert_close(w, ref, atol=ref.abs().max().item() * 2e-3, rtol=0)
    x = torch.randn(3, k)
    want = x.double() @ ref.double().t()
    for prepared in (False, True):  # the reference path, then the CPU form (int4 pack or bf16 copy)
        if prepared:
            layer.format.finish_loading(layer)
        got = layer(x)
        assert ((got - want).norm() / want.norm()).item() < 5e-3


def test_wrong_blocks_are_refused():
    with torch.device("meta"):
        layer = Linear(256, 32, fmt=GGUFFormat({"": T.Q4_K}))
    layer = layer.to_empty(device="cpu")
    with pytest.raises(ValueError, match="expects Q4_K blocks"):
        layer.weight_loaders["weight"].loader(layer, layer.weight, torch.zeros(32, 100, dtype=torch.uint8), None)


@pytest.fixture(scope="module")
def llms():
    kw = dict(dtype="float32", device="cpu", progress=False, kv_cache_memory_gb=0.05)
    return LLM(**kw), LLM(dequantize_gguf=True, **kw)


def _weight_bytes(llm) -> int:
    model = llm.engine.model
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_builtin_runs_from_packed_weights(llms):
    packed, dense = llms
    layer = packed.engine.model.model.layers[0].mlp.gate_up_proj
    assert type(layer.format).__name__ == "GGUFFormat" and layer.weight.dtype == torch.uint8
    assert _weight_bytes(packed) < _weight_bytes(dense) / 5


def test_builtin_packed_logprobs_and_greedy_match_dequantized(llms):
    packed, dense = llms
    ids = packed.get_tokenizer()(TEXT).input_ids
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    lp = [torch.tensor([o.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
          for o in (llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0] for llm in llms)]
    diff = (lp[0] - lp[1]).abs()
    # The packed CPU matmul takes bf16 activations: the bound is the error of the same dequantized model run
    # entirely in bf16 on this text (measured: mean 0.077, max 0.34 nats; packed: 0.052, 0.23).
    assert diff.mean() < 0.077 and diff.max() < 0.34, (diff.mean(), diff.max())
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": ids[:20]}
    got = packed.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    want = dense.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if a != b:  # allowed only where the dequantized model's top two are within 0.1 nats
            top = sorted((p.logprob for p in want.logprobs[i].values()), reverse=True)[:2]
            assert top[0] - top[1] < 0.1, (i, a, b, top)
            break


def test_a_type_nothing_can_load_is_refused_in_one_line():
    from types import SimpleNamespace

    from lamina.models.gguf_loader import _dequantized

    t = SimpleNamespace(name="blk.0.ffn_up.weight", tensor_type=T.Q8_1, data=np.zeros((2, 36), np.uint8))
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight' has type Q8_1.*kept quantized: Q4_0, Q4_1, Q4_K"):
        _dequantized(t)
