"""Tiny random hybrid / MoE checkpoints (saved by HF transformers) and HF oracles for the hybrid tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, initializer_range=0.1)
LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4)  # 2 value heads per key head: the grouped layout
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# GDN, full attention, GDN: the GDN layers carry state across the attention layer.
HYBRID_TYPES = ["linear_attention", "full_attention", "linear_attention"]
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

# family -> (HF config class, its kwargs, HF model class). qwen3_5 is saved as the multimodal model so its
# LM weights sit under model.language_model.* next to a vision tower; qwen3_5_moe as the text-only one.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(BASE, intermediate_size=128, **EXPERTS, mlp_only_layers=[1],
                                         norm_topk_prob=True), "Qwen3MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", dict(BASE, intermediate_size=128, **LINEAR, **EXPERTS,
                                           shared_expert_intermediate_size=48, layer_types=HYBRID_TYPES,
                                           mlp_only_layers=[2]), "Qwen3NextForCausalLM"),
    "qwen3_5": ("Qwen3_5Config", dict(text_config=dict(BASE, intermediate_size=128, **LINEAR,
                                                       layer_types=HYBRID_TYPES),
                                      vision_config=TINY_VISION), "Qwen3_5ForConditionalGeneration"),
    # Its shared expert is as wide as a routed one, so lamina folds it into the routed experts (qwen3_next's
    # is wider and stays separate): both layouts are tested.
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(BASE, **LINEAR, **EXPERTS, shared_expert_intermediate_size=32,
                                                 layer_types=HYBRID_TYPES), "Qwen3_5MoeForCausalLM"),
}


def make_hybrid_checkpoint(path: Path, family: str, tokenizer, seed: int = 0) -> Path:
    """Saves a random fp32 model of `family` with HF transformers, plus the tokenizer, into `path` (once)."""
    import transformers

    if (path / "config.json").is_file():
        return path
    cfg_name, kwargs, model_name = FAMILIES[family]
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if "text_config" in kwargs:
        kwargs = dict(kwargs, text_config=dict(kwargs["text_config"], **ids))
    else:
        kwargs = dict(kwargs, **ids)
    cfg = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hybrid_checkpoints(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.getbasetemp() / "hybrid_ckpt"
    return {f: make_hybrid_checkpoint(root / f, f, tokenizer, seed=10 + i) for i, f in enumerate(FAMILIES)}


def hf_model(path: Path):
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    model = hf_model(path)
    model.generation_config.eos_token_id = None  # never stop early, never ban EOS: like ignore_eos=True
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()
