"""A block-FP8 DeepSeek-V3 checkpoint (the layout of the published FP8 release: every attention projection,
expert and dense / shared MLP projection as float8_e4m3fn + weight_scale_inv, the router and norms dense)
loads, its latent attention absorbs the dequantized kv_b_proj, and it gives HF transformers' logprobs on the
dequantized fp32 copy; 32x32 blocks leave partial blocks on several projections (48 rows, 48 columns)."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from deepseek_factory import make_deepseek_checkpoint
from model_factory import hf_logprobs
from safetensors.torch import load_file, save_file

from lamina import LLM, SamplingParams
from lamina.kernels.fp8 import FP8, dequantize, quantize_blocks
from lamina.models.weight_formats.fp8 import Fp8Linear
from lamina.models.weight_formats.fp8_experts import Fp8Experts

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = (32, 32)
_QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.\w+_proj\w*|mlp\.(experts\.\d+\.|shared_experts\.)?"
                        r"(gate|up|down)_proj)\.weight$")
PROMPT = [(i * 7919) % 40000 + 100 for i in range(40)]


def write_fp8(src, dst):
    qdir, ddir = dst / "fp8", dst / "dequantized"
    for d in (qdir, ddir):
        shutil.copytree(src, d)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (qdir / "config.json").write_text(json.dumps(cfg))
    qt, dt = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if _QUANTIZED.match(name):
            q, s = quantize_blocks(t, BLOCK)
            qt[name], qt[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            dt[name] = dequantize(q, s, BLOCK).contiguous()
        else:
            qt[name] = dt[name] = t
    save_file(qt, str(qdir / "model.safetensors"))
    save_file(dt, str(ddir / "model.safetensors"))
    return qdir, ddir


def test_block_fp8_deepseek_v3_matches_hf_on_its_dequantized_copy(tmp_path, smol_tokenizer):
    src = make_deepseek_checkpoint(tmp_path / "src", "deepseek_v3", smol_tokenizer, seed=21)
    qdir, ddir = write_fp8(src, tmp_path)
    llm = LLM(model=str(qdir), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, progress=False,
              max_num_batched_tokens=7)
    fp8 = {n for n, m in llm.engine.model.named_modules() if isinstance(getattr(m, "format", None),
                                                                       (Fp8Linear, Fp8Experts))}
    assert "model.layers.1.self_attn.kv_b_proj" in fp8 and "model.layers.1.mlp.experts" in fp8
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in fp8 and "lm_head" not in fp8
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=8, prompt_logprobs=0, logprobs=0,
                                                                    temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    ref = hf_logprobs(ddir, PROMPT)
    assert (ours - ref[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]).abs().max().item() <= 1e-4
    gen = out.outputs[0].token_ids
    ref = hf_logprobs(ddir, PROMPT + gen)
    assert gen == [int(ref[len(PROMPT) - 1 + i].argmax()) for i in range(len(gen))]
    assert llm.engine.model.model.layers[1].self_attn.kv_b_proj.weight.dtype == FP8


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=12, prompt_logprobs=0, logprobs=0,
                                                                    temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    prompt = [out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))]
    return torch.tensor(prompt), out.outputs[0]


def test_fp8_latent_cache_within_the_rounding_bound(tmp_path, smol_tokenizer, monkeypatch):
    """--kv-cache-dtype fp8 stores the latent rows in e4m3 (one byte each: the pool plans with it), and the
    logprobs stay within 24x the error of the same model with a bf16 latent cache (the bound and its
    derivation: tests/test_fp8_kv_cache.py), over chunked prefill (expanded) and decode (absorbed)."""
    from lamina.engine import build

    path = make_deepseek_checkpoint(tmp_path / "src", "deepseek_v3", smol_tokenizer, seed=22)

    def make(**kw) -> LLM:
        return LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, progress=False,
                   max_num_batched_tokens=7, **kw)

    ref_p, ref_out = _prompt_logprobs(make())
    llm = make(kv_cache_dtype="fp8")
    assert {v.kv.dtype for v in llm.engine.kv_cache.views} == {FP8}
    assert llm.engine.state_layout.kv_bytes_per_block(4) == 3 * 4 * (32 + 16)
    fp8_p, fp8_out = _prompt_logprobs(llm)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks
    with monkeypatch.context() as m:
        m.setattr(build, "kv_storage_dtype", lambda config: torch.bfloat16)
        bf16_p, bf16_out = _prompt_logprobs(make())
    e8, e16 = (fp8_p - ref_p).abs().max().item(), (bf16_p - ref_p).abs().max().item()
    assert 0 < e8 <= 24 * e16 + 1e-3, (e8, e16)
    # decode: the logprob of the reference's greedy tokens, as long as the greedy paths agree
    n = next((i for i, (a, b) in enumerate(zip(fp8_out.token_ids, ref_out.token_ids)) if a != b), 12)
    d8 = max((abs(fp8_out.logprobs[i][t].logprob - ref_out.logprobs[i][t].logprob)
              for i, t in enumerate(ref_out.token_ids[:n])), default=0.0)
    assert n > 0 and d8 <= 24 * max(e16, 1e-4) + 1e-3
