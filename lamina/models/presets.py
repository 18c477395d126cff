"""Model shapes for benchmarks, loaded as `random:<name>`: an HF config with random weights (speed does not
depend on weight values; no checkpoint needs to exist)."""
from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, eos_token_id=151645, bos_token_id=151643),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, eos_token_id=151645, bos_token_id=151643),
    # Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults are that model) cut to 24 of its 48 layers,
    # so random bf16 weights (~80 GB) fit one H200 with room for the cache: 18 Gated DeltaNet + 6 gated
    # attention layers, 512 experts (top-10) + a shared expert in every layer.
    "qwen3-next-80b-a3b-24l": dict(architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
                                   intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                                   num_key_value_heads=2, head_dim=256, rope_theta=10000.0,
                                   partial_rotary_factor=0.25, max_position_embeddings=32768, rms_norm_eps=1e-6,
                                   linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                                   linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
                                   moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                   num_experts_per_tok=10, num_experts=512, norm_topk_prob=True, mlp_only_layers=[],
                                   full_attention_interval=4, tie_word_embeddings=False,
                                   eos_token_id=151645, bos_token_id=151643),
    # The same layout at toy size (CPU smoke runs of the hybrid paths).
    "tiny-qwen3-next": dict(architectures=["Qwen3NextForCausalLM"], vocab_size=32000, hidden_size=128,
                            intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, partial_rotary_factor=0.25, max_position_embeddings=8192,
                            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                            linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64, num_experts_per_tok=2, num_experts=8,
                            norm_topk_prob=True, full_attention_interval=4, eos_token_id=2, bos_token_id=1),
    # Gemma 3 4B's language model (5 sliding-window layers of 1024 per global layer, linear rope scaling 8
    # on the global ones) and Gemma 3 270M.
    "gemma3-4b": dict(architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=2560,
                      intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
                      rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                      max_position_embeddings=131072, rms_norm_eps=1e-6, eos_token_id=[1, 106], bos_token_id=2),
    "gemma3-270m": dict(architectures=["Gemma3ForCausalLM"], vocab_size=262144, hidden_size=640,
                        intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=256, query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                        rope_theta=1e6, rope_local_base_freq=1e4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                        eos_token_id=[1, 106], bos_token_id=2),
    # Nemotron-H 8B (52 single-sublayer blocks: 24 Mamba-2, 4 attention without RoPE, 24 relu2 MLPs) and the
    # same block kinds at toy size.
    "nemotron-h-8b": dict(architectures=["NemotronHForCausalLM"], vocab_size=131072, hidden_size=4096,
                          intermediate_size=21504, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          hybrid_override_pattern="M-M-M-M*-" + "M-M-M-M-M*-" * 3 + "M-M-M-M-M-",
                          mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
                          chunk_size=128, time_step_min=0.001, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5,
                          max_position_embeddings=8192, eos_token_id=2, bos_token_id=1),
    "tiny-nemotron-h": dict(architectures=["NemotronHForCausalLM"], vocab_size=32000, hidden_size=128,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            hybrid_override_pattern="M-M*-M-", mamba_num_heads=8, mamba_head_dim=32,
                            ssm_state_size=32, n_groups=2, conv_kernel=4, chunk_size=64, time_step_min=0.001,
                            mlp_hidden_act="relu2", max_position_embeddings=8192, eos_token_id=2, bos_token_id=1),
    # DeepSeek-V2-Lite (15.7B, 2.4B active; MLA without q_lora_rank, 64 experts top-6 + 2 shared, YaRN x40)
    # and DeepSeek-V3 cut to its 3 dense + 2 MoE layers (~53 GB in bf16: 256 experts top-8 in 8 groups).
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
                             intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
                             n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
                             topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
                             norm_topk_prob=False, rope_theta=10000.0, max_position_embeddings=163840,
                             rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                           "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                                           "beta_slow": 1},
                             rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001),
    "deepseek-v3-5l": dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
                           intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=5,
                           num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256,
                           n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, n_group=8,
                           topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, rope_theta=10000.0,
                           max_position_embeddings=163840,
                           rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
                           rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1),
    "tiny-deepseek-v3": dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=32000, hidden_size=128,
                             intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=96,
                             qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16,
                             n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=4,
                             topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                             max_position_embeddings=8192,
                             rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 2048,
                                           "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
                             eos_token_id=2, bos_token_id=1),
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=256, intermediate_size=768,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=4096, eos_token_id=2, bos_token_id=1),
}


def preset_config(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return dict(PRESETS[name])
