"""ModelConfig: an HF config.json or GGUF metadata normalized into per-layer specs for the one model loop."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LayerSpec:
    """What one decoder layer is made of.

    mixer: "attention" (full or sliding), "gated_attention" (Qwen3-Next: sigmoid output gate from a doubled
    q_proj), "gated_delta_net" (linear attention with conv + recurrent state in the state pool), "mamba2"
    (Mamba-2 SSD mixer, numbers in ModelConfig.mamba2), "mla" (multi-head latent attention over a paged latent
    cache; numbers in ModelConfig.mla), "none" (an FFN-only layer of a single-sublayer model);
    ffn: "dense" or "moe" (numbers in ModelConfig.moe), "plain" (up -> activation -> down, no gate: Nemotron-H's
    relu2 MLP), "relu2_moe" (Nemotron-H's MoE, numbers in ModelConfig.relu2_moe), "none" (a mixer-only layer of
    a single-sublayer model)."""

    mixer: str = "attention"
    ffn: str = "dense"
    sliding_window: int | None = None
    # This layer's own RoPE base and scaling (Gemma 3's sliding layers: rope_local_base_freq); None: the
    # model's rope_theta / rope_scaling.
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None


# Mixers that keep K/V in the paged KV pool (what each layer keeps is its own state_spec(); this is for
# FLOP estimates from a config alone).
KV_MIXERS = ("attention", "gated_attention")


@dataclass
class GatedDeltaNetSpec:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4

    @property
    def conv_dim(self) -> int:  # channels of the causal conv: q | k | v
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass
class Mamba2Spec:
    """A Mamba-2 mixer's numbers: H heads of P channels (intermediate = H * P), N state channels per head, G
    groups of B/C shared by H // G heads each, a causal conv of K taps over x | B | C, the SSD chunk length,
    dt clamped to [dt_min, dt_max] after softplus(dt + dt_bias), the gated norm's eps over groups of
    intermediate // G channels."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj / out_proj bias
    chunk_size: int = 256
    dt_min: float = 0.0
    dt_max: float = float("inf")
    norm_eps: float = 1e-5

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # channels of the causal conv: x | B | C
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclass
class Relu2MoESpec:
    """Nemotron-H's MoE block: sigmoid router scores plus a correction bias choose top_k of num_experts inside
    the topk_group best of n_group groups (a group scores by its two best experts); the chosen raw scores,
    renormalized if norm_topk_prob, times routed_scaling_factor, weight ungated experts (up -> activation ->
    down, optionally between latent projections of latent_size); one ungated shared expert is always added."""

    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    latent_size: int | None = None


@dataclass
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3; layers/mla.py): q through a low-rank q_a/q_b pair
    (q_lora_rank) or one q_proj (None); K/V compressed per token into a kv_lora_rank latent plus one shared
    qk_rope_head_dim rope key, which is all the cache keeps. rope_interleave: the rope dims come in (even,
    odd) pairs (V2 always; V3's default) rather than as two halves."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True


@dataclass
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # HF norm_topk_prob: rescale the top-k weights to sum to 1
    shared_intermediate_size: int = 0  # 0: no shared expert; else one, scaled by a sigmoid gate
    # DeepSeek-V2/V3 routing (layers/moe_routing.py): topk_method "greedy" | "group_limited_greedy" |
    # "noaux_tc" selects the fp32 GroupedTopKRouter; None: the softmax top-k router above (Qwen).
    topk_method: str | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # DeepSeek's ungated shared experts (mlp.shared_experts: one MLP of this width, always added); 0: none.
    shared_experts_intermediate_size: int = 0


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: list[LayerSpec]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w): 1.0 for Qwen3-Next/Qwen3.5's zero-centred w
    # Gemma 2/3: the sandwich layer (extra norms after attention and around the FFN), embeddings scaled by
    # sqrt(hidden) in the model dtype, attention scale query_pre_attn_scalar**-0.5 instead of head_dim's,
    # tanh soft-capping of attention scores and final logits (cap * tanh(x / cap); None: off).
    sandwich_norms: bool = False
    embed_scale: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    gdn: GatedDeltaNetSpec | None = None
    mamba2: Mamba2Spec | None = None
    relu2_moe: Relu2MoESpec | None = None
    # Nemotron-H: every layer is norm -> ONE sublayer (a mixer, or an FFN where its mixer is "none") ->
    # residual, instead of norm -> mixer -> norm -> FFN (layers/single_block.py).
    single_sublayer: bool = False
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    # config.json's quantization_config as written (models/quantization.py chooses the weight formats from it).
    quantization_config: dict[str, Any] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def rope_params(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers 5's `rope_parameters` or the older rope_theta/rope_scaling."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def eos_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]
