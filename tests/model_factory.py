"""Tiny random HF checkpoints (made with save_pretrained) and HF transformers as the logprob oracle."""
from __future__ import annotations

import random
from pathlib import Path

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15)

FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=12, head_dim=16)),
}


def make_checkpoint(path: Path, family: str, tokenizer, seed: int = 0, **overrides) -> Path:
    """Saves a random fp32 model of `family` with HF transformers, plus a tokenizer, into `path`."""
    import transformers

    cls_name, extra = FAMILY_CONFIGS[family]
    cfg = getattr(transformers, cls_name)(**{**SMALL, **extra, **overrides}, vocab_size=len(tokenizer),
                                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF transformers' logits at every position (eager attention, fp32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return logits.float().log_softmax(-1)


def shared_prefix_prompts(n_groups: int, per_group: int = 4, prefix_len: int = 22, seed: int = 0) -> list[dict]:
    """Groups of token-id prompts sharing a prefix (22 tokens by default: it ends inside a 4-token block)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        prefix = [rng.randrange(100, 40000) for _ in range(prefix_len)]
        out += [{"prompt_token_ids": prefix + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 9))]}
                for _ in range(per_group)]
    return out


def assert_within_bf16_noise(label: str, ours: torch.Tensor, ref: torch.Tensor, hf_bf16: torch.Tensor) -> None:
    """bf16 logprobs vs the fp32 oracle: our error may not exceed twice HF's own bf16 error (plus a floor
    for near-exact cases)."""
    hf_noise, ours_err = (hf_bf16 - ref).abs(), (ours - ref).abs()
    print(f"{label}: ours max {ours_err.max():.4f} mean {ours_err.mean():.5f}; "
          f"HF bf16 max {hf_noise.max():.4f} mean {hf_noise.mean():.5f}")
    assert ours_err.mean() <= 2 * hf_noise.mean() + 1e-3
    assert ours_err.max() <= 2 * hf_noise.max() + 1e-2
