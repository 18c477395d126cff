"""The real SmolLM2-135M-Instruct GGUF: greedy parity with HF transformers' own GGUF loader (the oracle)."""
from __future__ import annotations

import pytest
import torch

from lamina import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    from lamina.models.loader import DEFAULT_MODEL, resolve_source

    src = resolve_source(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name,
                                                              dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like ignore_eos: run all 64 steps without banning EOS
    return model


@pytest.fixture(scope="module")
def llm():
    # The dequantized weights: HF runs the same fp32 values (the packed default is tested in test_gguf_packed.py).
    return LLM(dtype="float32", device="cpu", progress=False, dequantize_gguf=True)


def test_greedy_64_tokens_match_hf(llm, hf_model):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt
        assert out.outputs[0].text == tok.decode(ref[0, len(ids):], skip_special_tokens=True)


def test_chat_template_and_eos(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # stopped on <|im_end|>, not by length
