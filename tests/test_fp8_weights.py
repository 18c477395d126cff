"""FP8 weights end to end on the CPU path: checkpoints written to the published formats (quant_method "fp8"
with block scales; compressed-tensors via its own compressor) load, dequantize to exactly what the format's
definition / library says, and give HF transformers' logprobs on the dequantized fp32 copy (tight: the same
weights, so only summation order differs). Against the original fp32 model the bound is loose and derived
from the rounding: e4m3 keeps 3 mantissa bits where bf16 keeps 7, so weight rounding error is 16x bf16's;
we allow 1.5x that (24x HF's own logprob error with bf16-rounded weights; measured: 9-12x on these models,
less on the MoE one)."""
from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import block_quantizer, write_quantized
from hybrid_helpers import make_hybrid_checkpoint
from model_factory import hf_logprobs
from test_parity_hf import PROMPT, prompt_logprobs

from lamina import LLM
from lamina.kernels.fp8 import FP8, dequantize, quantize_rows
from lamina.models.weight_formats.fp8 import Fp8Linear
from lamina.models.weight_formats.fp8_experts import Fp8Experts

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}


def chosen(ref: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def lamina_logprobs(path, **kw) -> tuple[torch.Tensor, LLM]:
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4, progress=False, **kw)
    return prompt_logprobs(llm, PROMPT), llm


def bf16_weight_error(path, tmp_path) -> float:
    """HF's own logprob error when the fp32 checkpoint's weights are rounded to bf16 (the yardstick)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
        rounded = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    return (chosen(rounded, PROMPT) - chosen(ref, PROMPT)).abs().max().item()


def fp8_layers(llm: LLM):
    return {n: m for n, m in llm.engine.model.named_modules() if isinstance(getattr(m, "format", None),
                                                                         (Fp8Linear, Fp8Experts))}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory, smol_tokenizer):
    return make_hybrid_checkpoint(tmp_path_factory.getbasetemp() / "hybrid_ckpt" / "qwen3_moe", "qwen3_moe",
                                  smol_tokenizer, seed=10)


@pytest.mark.parametrize("family", ["llama", "qwen2", "moe"])
def test_block_fp8_checkpoint_matches_hf_on_its_dequantized_copy(checkpoints, moe_checkpoint, family, tmp_path):
    src = moe_checkpoint if family == "moe" else checkpoints[family]
    qdir, ddir = write_quantized(src, tmp_path, block_quantizer((16, 16)), BLOCK_CONFIG)
    ours, llm = lamina_logprobs(qdir)
    layers = fp8_layers(llm)
    assert layers and all(m.format.scheme.block == (16, 16) for m in layers.values())
    assert all(m.weight.dtype == FP8 for m in layers.values() if isinstance(m.format, Fp8Linear))
    assert "lm_head" not in layers and not any(n.endswith("mlp.gate") for n in layers)
    assert any(isinstance(m.format, Fp8Experts) for m in layers.values()) == (family == "moe")
    assert (ours - chosen(hf_logprobs(ddir, PROMPT), PROMPT)).abs().max().item() <= 1e-4
    # Loose: against the original fp32 weights (see the module docstring for the factor).
    err = (ours - chosen(hf_logprobs(src, PROMPT), PROMPT)).abs().max().item()
    assert err <= 24 * bf16_weight_error(src, tmp_path) + 1e-3, err


def test_online_fp8_quantizes_rows_of_the_dense_checkpoint(checkpoints, moe_checkpoint, tmp_path):
    """--quantization fp8: every decoder projection (fused q|k|v and gate|up loaded shard by shard) holds the
    per-row quantization of the checkpoint's weight, lm_head/embeddings/router stay dense."""
    from safetensors.torch import load_file

    from lamina.models.families.common import hf_target

    for src in (checkpoints["llama"], moe_checkpoint):
        ours, llm = lamina_logprobs(src, quantization="fp8")
        layers = fp8_layers(llm)
        assert layers and "lm_head" not in layers
        model_params = dict(llm.engine.model.named_parameters())
        for name, t in load_file(str(src / "model.safetensors")).items():
            target = hf_target(name)
            module = target.param.rpartition(".")[0]
            if module not in layers or not isinstance(layers[module].format, Fp8Linear):
                continue
            layer = layers[module]
            q, s = quantize_rows(t)
            rows = slice(None)
            if target.shard:
                from lamina.models.weight_formats.fp8 import shard_rows

                rows = shard_rows(layer.out_shards, target.shard)
            assert torch.equal(model_params[target.param][rows].float(), q.float()), name
            assert torch.equal(layer.weight_scale[rows], s), name
        # The dequantized model as HF runs it: the same numbers within summation order.
        ref = fp8_reference_logprobs(llm, src, tmp_path)
        assert (ours - ref).abs().max().item() <= 1e-4
        assert (ours - chosen(hf_logprobs(src, PROMPT), PROMPT)).abs().max().item() <= \
            24 * bf16_weight_error(src, tmp_path) + 1e-3


def fp8_reference_logprobs(llm: LLM, src, tmp_path) -> torch.Tensor:
    """HF transformers on the fp32 checkpoint with every FP8 layer's weights replaced by their dequantized
    values (read back from the loaded lamina model)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    hf = dict(model.named_parameters())
    with torch.no_grad():
        for name, layer in fp8_layers(llm).items():
            if isinstance(layer.format, Fp8Experts):
                w13, w2 = layer.format.dense_stacks(layer, torch.float32)
                hf[f"{name}.gate_up_proj"].copy_(w13)
                hf[f"{name}.down_proj"].copy_(w2)
                continue
            w = layer.format.dense_weight(layer)
            parent, _, own = name.rpartition(".")
            names = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(
                own, [own])
            for part, sub in zip(names, w.split(list(layer.out_shards.values()))):
                hf[f"{parent}.{part}.weight"].copy_(sub)
        logits = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    return chosen(logits, PROMPT)


def test_block_scales_dequantize_per_block():
    """The format definition itself: weight_scale_inv[i, j] multiplies block (i, j) of the FP8 weight."""
    q = torch.ones(32, 48).to(FP8)
    s = torch.arange(6, dtype=torch.float32).view(2, 3) + 1
    w = dequantize(q, s, (16, 16))
    assert w[15, 15] == 1 and w[16, 15] == 4 and w[0, 47] == 3 and w[31, 47] == 6


def test_random_preset_quantizes_online_for_benchmarks():
    """`lamina bench latency --model random:P --quantization fp8`: random weights go through the FP8 loaders."""
    from lamina import SamplingParams
    from lamina.args import CliParser, add_engine_args, engine_kwargs

    p = CliParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "random:tiny-llama", "--quantization", "fp8", "--device", "cpu",
                         "--kv-cache-memory-gb", "0.05"])
    kw = engine_kwargs(args)
    assert kw["quantization"] == "fp8" and kw["kv_cache_dtype"] == "auto"
    llm = LLM(**kw, progress=False)
    layers = fp8_layers(llm)
    assert len(layers) == 4 * 4 and all(m.weight.dtype == FP8 and m.weight_scale.abs().sum() > 0
                                        for m in layers.values())
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "int3"])
