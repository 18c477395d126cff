"""Tiny random Mamba-2 hybrid checkpoints (Nemotron-H, Bamba) saved by HF transformers, for the mamba2 tests.

Small scan chunks (16) and a 4-tap conv, so the tests' chunked prefills cut inside conv windows and scan
chunks; several heads per B/C group (the grouped layout) and more than one group (the grouped gated norm)."""
from __future__ import annotations

from pathlib import Path

import torch

CHUNK = 16
# dt clamped from below in both (a clamp that bites on these random weights): transformers >= 5.25 clamps its
# chunked scan to time_step_limit, earlier versions to time_step_min, so both name the same bound.
DT_LIMIT = (0.01, float("inf"))
# Every block kind of the pattern, Mamba layers carrying state across attention and MLP layers.
NEMOTRON_PATTERN = "M*-M-M"
NEMOTRON_MOE_PATTERN = "ME*EM"
FAMILIES = {
    "nemotron_h": ("NemotronHConfig", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layers_block_type=[{"M": "linear_attention", "*": "full_attention", "-": "mlp"}[c] for c in NEMOTRON_PATTERN],
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=CHUNK,
        max_position_embeddings=512, initializer_range=0.1, time_step_min=0.01, time_step_max=0.5,
        time_step_limit=DT_LIMIT),
        "NemotronHForCausalLM"),
    # Mamba-2 with MoE blocks (grouped sigmoid routing with a correction bias, relu2 experts, a shared expert).
    "nemotron_h_moe": ("NemotronHConfig", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layers_block_type=[{"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}[c]
                           for c in NEMOTRON_MOE_PATTERN],
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=CHUNK,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=512, initializer_range=0.1, time_step_min=0.01, time_step_max=0.5,
        time_step_limit=DT_LIMIT),
        "NemotronHForCausalLM"),
    "bamba": ("BambaConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=CHUNK, max_position_embeddings=512,
        initializer_range=0.1), "BambaForCausalLM"),
}


def make_mamba2_checkpoint(path: Path, family: str, tokenizer, seed: int = 0) -> Path:
    """Saves a random fp32 model of `family` with HF transformers, plus the tokenizer, into `path` (once)."""
    import transformers

    if (path / "config.json").is_file():
        return path
    cfg_name, kwargs, model_name = FAMILIES[family]
    kwargs = dict(kwargs, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    cfg = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float()
    with torch.no_grad():  # HF initializes D to ones and dt_bias to a fixed range: spread them so they are tested
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            elif name.endswith((".D", ".dt_bias")):
                p.add_(torch.randn_like(p) * 0.5)
            elif name.endswith("norm.weight"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def mamba2_checkpoints(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.getbasetemp() / "mamba2_ckpt"
    return {f: make_mamba2_checkpoint(root / f, f, tokenizer, seed=30 + i) for i, f in enumerate(FAMILIES)}
