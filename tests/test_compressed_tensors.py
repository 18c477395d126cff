"""compressed-tensors FP8 checkpoints, quantized by the compressed-tensors package's own compressor: lamina's
loaded weights dequantize to exactly what the package's decompression gives, and logprobs match HF on that
decompressed copy. Plus the refusals: unsupported methods, schemes, block sizes and wrong-shaped scales are
one line naming what is supported, raised before any weight is read."""
from __future__ import annotations

import json

import pytest
import torch
from fp8_checkpoints import block_quantizer, write_quantized
from model_factory import hf_logprobs
from safetensors.torch import load_file, save_file
from test_fp8_weights import BLOCK_CONFIG, chosen, fp8_layers, lamina_logprobs, moe_checkpoint  # noqa: F401
from test_parity_hf import PROMPT

from lamina.models.loader import build_model, read_config, resolve_source
from lamina.models.quantization import format_chooser
from lamina.models.weight_formats.fp8 import Fp8Linear

pytestmark = pytest.mark.usefixtures("one_thread")
ct = pytest.importorskip("compressed_tensors")

DYNAMIC = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
SCHEMES = {
    "channel-dynamic": ({"strategy": "channel"}, DYNAMIC),
    "tensor-static": ({"strategy": "tensor"}, STATIC),
    "block-weight-only": ({"strategy": "block", "block_structure": [16, 32]}, None),
}


def ct_config(weights: dict, acts: dict | None, ignore=("lm_head",)) -> dict:
    w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, **weights}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": acts}}}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_ct_fp8_matches_the_package_decompression(checkpoints, tmp_path, name):
    from compressed_tensors.quantization import QuantizationScheme
    from fp8_checkpoints import ct_quantizer

    weights, acts = SCHEMES[name]
    cfg = ct_config(weights, acts)
    scheme = QuantizationScheme(**cfg["config_groups"]["group_0"])
    src = checkpoints["qwen2"]  # biases on q/k/v; tied embeddings
    qdir, ddir = write_quantized(src, tmp_path, ct_quantizer(scheme), cfg)
    ours, llm = lamina_logprobs(qdir)
    layers = fp8_layers(llm)
    assert len(layers) == 4 * 2 and all(isinstance(m.format, Fp8Linear) for m in layers.values())
    assert all(m.format.scheme.static_input == (acts is STATIC) for m in layers.values())
    decompressed = load_file(str(ddir / "model.safetensors"))
    for lname, layer in layers.items():  # the weights themselves, bit for bit
        parent, _, own = lname.rpartition(".")
        parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(own, [own])
        want = torch.cat([decompressed[f"{parent}.{p}.weight"] for p in parts])
        assert torch.equal(layer.format.dense_weight(layer), want), lname
    assert (ours - chosen(hf_logprobs(ddir, PROMPT), PROMPT)).abs().max().item() <= 1e-4


def test_ct_ignore_and_regex_targets(checkpoints):
    cfg, _ = read_config(resolve_source(str(checkpoints["llama"])))
    qc = ct_config({"strategy": "channel"}, DYNAMIC, ignore=["lm_head", "re:.*mlp\\.down_proj$"])
    qc["config_groups"]["group_0"]["targets"] = ["re:.*self_attn\\..*", "re:.*mlp\\..*"]
    model = build_model(cfg, torch.float32, torch.device("meta"), format_chooser(qc, cfg))
    kinds = {n: type(m.format).__name__ for n, m in model.named_modules() if hasattr(m, "format")}
    assert kinds["model.layers.0.self_attn.qkv_proj"] == "Fp8Linear"
    assert kinds["model.layers.1.mlp.gate_up_proj"] == "Fp8Linear"
    assert kinds["model.layers.1.mlp.down_proj"] == "DenseFormat" and kinds["lm_head"] == "DenseFormat"
    # Ignoring only k_proj would leave the fused q|k|v half quantized: refused.
    qc["ignore"] = ["re:.*k_proj$"]
    with pytest.raises(ValueError, match="only some parts of the fused layer model.layers.0.self_attn.qkv_proj"):
        build_model(cfg, torch.float32, torch.device("meta"), format_chooser(qc, cfg))


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "bitsandbytes"}, r"unsupported quantization method 'bitsandbytes'; supported: .*compressed-"
                                       r"tensors, fp8"),
    (dict(BLOCK_CONFIG, weight_block_size=[100, 128]), r"unsupported FP8 weight block size \[100, 128\]; supported"),
    (dict(BLOCK_CONFIG, fmt="e5m2"), r"unsupported FP8 format 'e5m2'.*supported: e4m3"),
    (dict(BLOCK_CONFIG, activation_scheme="static"), "supports activation_scheme 'dynamic' only"),
    (ct_config({"strategy": "channel", "num_bits": 8, "type": "int"}, None), r"unsupported compressed-tensors "
                                                                            r"scheme 'group_0' \(int 8-bit"),
    (ct_config({"strategy": "group", "group_size": 128}, DYNAMIC), r"scheme \(float 8-bit weights, strategy group"),
    (ct_config({"strategy": "channel", "symmetric": False}, DYNAMIC), "unsupported compressed-tensors scheme"),
])
def test_unsupported_quantization_is_refused_in_one_line(checkpoints, qc, message):
    cfg, _ = read_config(resolve_source(str(checkpoints["llama"])))
    with pytest.raises(ValueError, match=message) as info:
        build_model(cfg, torch.float32, torch.device("meta"), format_chooser(qc, cfg))
    assert "\n" not in str(info.value)


def test_int4_pack_quantized_routes_to_the_int4_chooser_or_is_refused(checkpoints, monkeypatch):
    from lamina.models.weight_formats import compressed_tensors as ctmod

    cfg, _ = read_config(resolve_source(str(checkpoints["llama"])))
    qc = ct_config({"strategy": "group", "group_size": 32, "num_bits": 4, "type": "int"}, None)
    qc["format"] = "pack-quantized"
    monkeypatch.setattr(ctmod, "INT4_CHOOSER", "lamina.models.weight_formats.no_such_module:choose")
    with pytest.raises(ValueError, match="int4 pack-quantized weights need .*no_such_module"):
        format_chooser(qc, cfg)
    seen = []
    monkeypatch.setattr(ctmod, "INT4_CHOOSER", f"{__name__}:fake_int4_chooser")
    globals()["fake_int4_chooser"] = lambda scheme, name, layer: seen.append((scheme["weights"]["num_bits"], name))
    choose = format_chooser(qc, cfg)
    choose("model.layers.0.self_attn.o_proj", build_model(cfg, torch.float32, torch.device("meta")).get_submodule(
        "model.layers.0.self_attn.o_proj"))
    assert seen == [(4, "model.layers.0.self_attn.o_proj")]


def test_wrong_scales_and_dtypes_are_refused_at_load(checkpoints, tmp_path):
    src = checkpoints["llama"]
    qdir, _ = write_quantized(src, tmp_path, block_quantizer((16, 16)), BLOCK_CONFIG)
    tensors = load_file(str(qdir / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    bad = dict(tensors, **{name: tensors[name][:, :-1].contiguous()})
    save_file(bad, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"k_proj.weight_scale_inv.*expects shape \(2, 4\).*\(2, 3\)"):
        lamina_logprobs(qdir)
    bad = dict(tensors, **{"model.layers.0.self_attn.k_proj.weight":
                           tensors["model.layers.0.self_attn.k_proj.weight"].float()})
    save_file(bad, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match="expects a float8_e4m3fn tensor, the checkpoint has torch.float32"):
        lamina_logprobs(qdir)
    # An already quantized checkpoint with another online method.
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = ct_config({"strategy": "channel"}, DYNAMIC)
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="already quantized \\('compressed-tensors'\\); drop --quantization fp8"):
        lamina_logprobs(qdir, quantization="fp8")


def test_tied_lm_head_stays_dense_without_an_ignore_entry(checkpoints):
    """A tied lm_head reads the embedding table, so "Linear" targets cannot make it FP8."""
    cfg, _ = read_config(resolve_source(str(checkpoints["qwen2"])))
    assert cfg.tie_word_embeddings
    model = build_model(cfg, torch.float32, torch.device("meta"),
                        format_chooser(ct_config({"strategy": "channel"}, DYNAMIC, ignore=()), cfg))
    assert type(model.lm_head.format).__name__ == "DenseFormat"
    assert type(model.model.layers[0].mlp.down_proj.format).__name__ == "Fp8Linear"


def test_ct_fp8_moe_experts_per_tensor(moe_checkpoint, tmp_path):  # noqa: F811
    """Per-expert compressed-tensors tensors (experts.N.gate_proj.weight / weight_scale, one scale per
    tensor) load into the FP8 expert stacks; logprobs match HF on the package's decompressed copy."""
    from compressed_tensors.quantization import QuantizationScheme
    from fp8_checkpoints import ct_quantizer

    from lamina.models.weight_formats.fp8_experts import Fp8Experts

    cfg = ct_config({"strategy": "tensor"}, DYNAMIC, ignore=["lm_head", "re:.*mlp\\.gate$"])
    qdir, ddir = write_quantized(moe_checkpoint, tmp_path, ct_quantizer(QuantizationScheme(
        **cfg["config_groups"]["group_0"])), cfg)
    ours, llm = lamina_logprobs(qdir)
    kinds = {type(m.format).__name__ for m in fp8_layers(llm).values()}
    assert kinds == {"Fp8Linear", "Fp8Experts"}
    experts = next(m for m in fp8_layers(llm).values() if isinstance(m.format, Fp8Experts))
    assert experts.gate_up_proj_weight_scale.shape == (4, 64)  # per-tensor scales spread over their rows
    assert (ours - chosen(hf_logprobs(ddir, PROMPT), PROMPT)).abs().max().item() <= 1e-4
