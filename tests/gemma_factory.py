"""Tiny random Gemma 2 / Gemma 3 checkpoints (save_pretrained) for the parity, prefix-cache and verify tests.

Small sizes, a sliding window (6) much shorter than the test prompts, query_pre_attn_scalar different from
head_dim, Gemma 2 soft-caps small enough to bend random scores and logits, Gemma 3 local and global RoPE
bases that differ (the global one linearly scaled), and RMSNorm weights perturbed away from HF's zero init
so that the (1 + w) scale is exercised.
"""
from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 6
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.15,
             sliding_window=WINDOW, query_pre_attn_scalar=24)
_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}
GEMMA_FAMILIES = ("gemma2", "gemma3_text", "gemma3")


def _config(family: str, tokenizer, sliding_only: bool = False):
    import transformers

    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.eos_token_id)
    types = ["sliding_attention"] * 4 if sliding_only else _TYPES
    if family == "gemma2":
        return transformers.Gemma2Config(**_TEXT, **ids, layer_types=types, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=3.0)
    text = transformers.Gemma3TextConfig(**_TEXT, **ids, layer_types=types, rope_parameters=_GEMMA3_ROPE)
    if family == "gemma3_text":
        return text
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     image_token_index=len(tokenizer) - 1, boi_token_index=len(tokenizer) - 2,
                                     eoi_token_index=len(tokenizer) - 3)


def make_gemma_checkpoint(path: Path, family: str, tokenizer, seed: int = 0, sliding_only: bool = False) -> Path:
    import transformers

    cfg = _config(family, tokenizer, sliding_only)
    torch.manual_seed(seed)
    if family == "gemma3":
        model = transformers.Gemma3ForConditionalGeneration(cfg).float()
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def gemma_hf_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """HF transformers' log_softmax at every position (eager attention, fp32), any of the three families."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return logits.float().log_softmax(-1)
