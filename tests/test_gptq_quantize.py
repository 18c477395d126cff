"""scripts/gptq_quantize.py end to end on tiny random checkpoints: GPTQ with a calibration Hessian, the GPTQ v1
checkpoint it writes loaded by lamina's own loader (from config.json's quantization_config) and run from its
packed weights, against HF transformers running the dequantized model the script leaves behind."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gptq_quantize.py"


def _script():
    spec = importlib.util.spec_from_file_location("gptq_quantize", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("family,act_order", [("llama", True), ("qwen2", False)])
def test_gptq_checkpoint_loads_in_lamina_and_matches_the_dequantized_model(checkpoints, tmp_path, one_thread,
                                                                           family, act_order):
    import transformers

    from lamina import LLM, SamplingParams

    gq = _script()
    src = checkpoints[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(4)
    samples = [torch.randint(3, 400, (1, 48), generator=gen) for _ in range(4)]  # calibration != evaluation
    before = {n: p.clone() for n, p in model.named_parameters()}
    results = gq.quantize_model(model, samples, group=32, act_order=act_order, log=lambda *_: None)
    assert len(results) == 7 * model.config.num_hidden_layers
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed and all(n.removesuffix(".weight") in results for n in changed)  # only the linears moved
    out = tmp_path / "gptq"
    gq.write_checkpoint(model, results, out, 4, 32, act_order, False)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)

    llm = LLM(str(out), dtype="float32", device="cpu", progress=False, kv_cache_memory_gb=0.05)
    layer = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert type(layer.format).__name__ == "GPTQFormat"
    assert (layer.__dict__["_perm"] is not None) == act_order
    ids = [int(i) for i in torch.randint(3, 400, (40,), generator=torch.Generator().manual_seed(2))]
    res = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ours = torch.tensor([res[0].prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = torch.tensor([ref[i - 1, ids[i]].item() for i in range(1, len(ids))])
    # the CPU int4 matmul takes bf16 activations: bf16-level agreement, not fp32's
    assert (ours - want).abs().max() < 0.05, (ours - want).abs().max()


def _lamina_vs_hf(out: Path, model) -> tuple[object, torch.Tensor]:
    """(the LLM, |lamina logprobs - HF logprobs on `model`|) over one 40-token prompt."""
    from lamina import LLM, SamplingParams

    llm = LLM(str(out), dtype="float32", device="cpu", progress=False, kv_cache_memory_gb=0.05)
    ids = [int(i) for i in torch.randint(3, 400, (40,), generator=torch.Generator().manual_seed(2))]
    res = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ours = torch.tensor([res[0].prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = torch.tensor([ref[i - 1, ids[i]].item() for i in range(1, len(ids))])
    return llm, (ours - want).abs()


@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_fp8_checkpoint_loads_in_lamina_and_matches_the_dequantized_model(checkpoints, tmp_path, one_thread, method):
    """--format fp8: a compressed-tensors FP8 checkpoint (per-channel scales, weight-only) that lamina loads as
    row-scaled Fp8Linear holding exactly the weights the solver stored; logprobs equal HF's on the dequantized
    copy (fp32 activations on the CPU: the reference path, no activation rounding)."""
    import transformers
    from safetensors.torch import load_file

    gq = _script()
    src = checkpoints["qwen2"]  # q/k/v biases, tied embeddings
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(4)
    samples = [torch.randint(3, 400, (1, 48), generator=gen) for _ in range(4)]
    results = gq.quantize_model(model, samples, act_order=True, log=lambda *_: None, fmt="fp8", method=method)
    assert len(results) == 7 * model.config.num_hidden_layers
    out = tmp_path / "fp8"
    gq.write_checkpoint(model, results, out, 8, 0, True, True, fmt="fp8")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    stored = load_file(str(out / "model.safetensors"))
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    llm, diff = _lamina_vs_hf(out, model)
    layer = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert type(layer.format).__name__ == "Fp8Linear" and layer.format.scheme.block is None
    want = torch.cat([model.model.layers[0].self_attn.get_submodule(p).weight for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(layer.format.dense_weight(layer), want)  # the solver's weights, bit for bit
    assert diff.max() < 1e-4, diff.max()
    ct = pytest.importorskip("compressed_tensors")  # the format's own library reads the same weights
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(**gq.FP8_CONFIG["config_groups"]["group_0"])
    name = "model.layers.1.mlp.down_proj"
    deq = FloatQuantizationCompressor.decompress(
        {"weight": stored[f"{name}.weight"], "weight_scale": stored[f"{name}.weight_scale"]}, scheme)["weight"]
    assert ct and torch.equal(deq.float(), model.get_submodule(name).weight)


def test_rtn_gptq_checkpoint_needs_no_calibration(checkpoints, tmp_path, one_thread):
    """--method rtn: round-to-nearest int4 groups, the baseline that GPTQ's rows are compared with."""
    import transformers

    gq = _script()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    w = model.model.layers[1].mlp.down_proj.weight.clone()
    results = gq.quantize_model(model, [], group=32, log=lambda *_: None, method="rtn")
    from lamina.models.weight_formats.gptq_solver import rtn_quantize

    assert torch.equal(results["model.layers.1.mlp.down_proj"].q, rtn_quantize(w, group=32).q)
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, rtn_quantize(w, group=32).dequantize())
