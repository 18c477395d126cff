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
