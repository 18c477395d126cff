"""Logprob parity with HF transformers (the oracle) for every dense family, on random fp32 checkpoints."""
from __future__ import annotations

import pytest
import torch
from model_factory import FAMILY_CONFIGS, hf_logprobs

from lamina import LLM, SamplingParams

PROMPT = list(range(1000, 1040)) + [5, 17, 923, 4000, 31, 77, 12, 5000]  # 48 tokens, past Mistral's window 12


def prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
@pytest.mark.parametrize("chunk", [2048, 7])  # 7: chunked prefill cuts the prompt inside and across blocks
def test_prompt_logprobs_match_hf(checkpoints, family, chunk):
    path = checkpoints[family]
    ref = hf_logprobs(path, PROMPT)
    ref_chosen = ref[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4,
              max_num_batched_tokens=chunk, progress=False)
    ours = prompt_logprobs(llm, PROMPT)
    assert (ours - ref_chosen).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_decode_logprobs_match_hf(checkpoints, family):
    """Greedy decode steps read the paged cache: each sampled token's logprob must match HF on the full sequence."""
    path = checkpoints[family]
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4, progress=False)
    out = llm.generate({"prompt_token_ids": PROMPT[:20]},
                       SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    full = PROMPT[:20] + gen
    ref = hf_logprobs(path, full)
    for i, tok in enumerate(gen):
        row = ref[20 + i - 1]
        assert tok == int(row.argmax()), f"greedy token {i} differs from HF"
        assert abs(out.outputs[0].logprobs[i][tok].logprob - row[tok].item()) <= 1e-4


def test_family_is_chosen_from_config(checkpoints):
    from lamina.models.hf_loader import read_hf_config
    from lamina.models.registry import config_from_hf

    cfgs = {f: config_from_hf(read_hf_config(p)) for f, p in checkpoints.items()}
    assert cfgs["qwen2"].attention_bias and cfgs["qwen2"].tie_word_embeddings
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 32
    assert cfgs["mistral"].layers[0].sliding_window == 12
    assert cfgs["llama"].rope_scaling["rope_type"] == "llama3"
