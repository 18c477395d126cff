"""Bad quantized checkpoints (issue 15, item 7), end to end through the loader: an unsupported method, block
size, bit width or group is refused at load in one line that names it and lists what is supported, before
any weight is read; scales of the wrong shape are refused naming the tensor, for linears and expert stacks."""
from __future__ import annotations

import json
import shutil

import pytest
import torch


def _config_only(src, dst, quant: dict, weights: bool = False):
    """A checkpoint directory with config.json (plus quantization_config) and the tokenizer, and by default no
    weight file: a refusal must come before any weight is looked for."""
    dst.mkdir()
    for f in src.iterdir():
        if weights or not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    return dst


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     r"^unsupported quantization method 'bitsandbytes'; supported: awq, compressed-tensors, fp8, gptq$"),
    ({"quant_method": "HQQ"}, r"^unsupported quantization method 'hqq'; supported: .*gptq$"),
    ({"quant_method": "fp8", "weight_block_size": [128, 96]},
     r"^unsupported FP8 weight block size \[128, 96\]; supported: .*powers of two"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"^unsupported FP8 weight block size \[128\]"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, r"^unsupported weight bit width 8; supported: 4$"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, r"^unsupported group size 100.*supported: a multiple"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
     r"^unsupported GPTQ checkpoint_format 'marlin'; supported: gptq, gptq_v2$"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"},
     r"^unsupported AWQ version 'gemv'; supported: gemm$"),
])
def test_unsupported_quantization_is_refused_at_load_in_one_line(checkpoints, tmp_path, quant, message):
    from lamina import LLM

    ckpt = _config_only(checkpoints["llama"], tmp_path / "bad", quant)
    with pytest.raises(ValueError, match=message) as info:
        LLM(str(ckpt), dtype="float32", device="cpu", progress=False, kv_cache_memory_gb=0.05)
    assert "\n" not in str(info.value)


def test_cli_prints_the_refusal_as_one_line(checkpoints, tmp_path, capsys):
    from lamina.cli import main

    # with weights: the command line's preflight checks that weight files exist before anything loads
    ckpt = _config_only(checkpoints["llama"], tmp_path / "bad", {"quant_method": "squeezellm"}, weights=True)
    assert main(["generate", "--model", str(ckpt), "--device", "cpu", "hi"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "squeezellm" in line]
    assert len(lines) == 1 and "supported: awq, compressed-tensors, fp8, gptq" in lines[0], err


def _experts(fmt):
    from lamina.models.layers.moe import FusedExperts

    with torch.device("meta"):
        layer = FusedExperts(2, 32, 16, fmt=fmt)
    return layer.to_empty(device="cpu")


def test_fp8_expert_scales_of_the_wrong_shape_are_refused():
    from lamina.models.weight_formats.fp8 import Fp8Scheme
    from lamina.models.weight_formats.fp8_experts import Fp8Experts

    layer = _experts(Fp8Experts(Fp8Scheme(block=(16, 16))))
    name = "gate_up_proj_weight_scale_inv"
    load = layer.weight_loaders[name].loader
    load(layer, getattr(layer, name), torch.ones(1, 2), "gate", 0)  # [I/bn, H/bk]: fine
    with pytest.raises(ValueError, match=r"expert 1's gate block expects shape \(1, 2\), the checkpoint has \(2, 2\)"):
        load(layer, getattr(layer, name), torch.ones(2, 2), "gate", 1)
    rows = _experts(Fp8Experts(Fp8Scheme(block=None, scale_name="weight_scale")))
    with pytest.raises(ValueError, match="expert 0's down"):
        rows.weight_loaders["down_proj_weight_scale"].loader(rows, rows.down_proj_weight_scale, torch.ones(31), None, 0)


def test_fp8_expert_blocks_must_tile_the_intermediate_size():
    from lamina.models.weight_formats.fp8 import Fp8Scheme
    from lamina.models.weight_formats.fp8_experts import Fp8Experts

    with pytest.raises(ValueError, match="FP8 block size 32 does not divide the experts' intermediate size 16"):
        _experts(Fp8Experts(Fp8Scheme(block=(32, 16))))


def test_gptq_expert_tensors_of_the_wrong_shape_are_refused():
    from lamina.models.weight_formats.int4_experts import GPTQExperts

    layer = _experts(GPTQExperts(4, 16))
    name = "down_proj_scales"  # [I/G, H] = (1, 32) per expert
    with pytest.raises(ValueError, match=r"expert 0's down scales expects shape \(1, 32\), the checkpoint has \(2, "):
        layer.weight_loaders[name].loader(layer, getattr(layer, name), torch.ones(2, 32, dtype=torch.float16), None, 0)
    name = "gate_up_proj_qweight"  # gate: [H/8, I] = (4, 16)
    with pytest.raises(ValueError, match=r"expert 1's gate qweight expects shape \(4, 16\)"):
        layer.weight_loaders[name].loader(layer, getattr(layer, name), torch.zeros(4, 32, dtype=torch.int32), "gate", 1)
