"""How a model is split over tensor-parallel ranks: what is supported (checked at start-up, one line when
not), which weight format each layer gets, and the head counts each rank's attention layers compute.

The split (Megatron-style, one all-reduce per sublayer):
- attention: query heads split evenly; KV heads split evenly when there are at least as many as ranks, else
  each rank keeps the one KV head its query heads share (replicated over world / num_kv_heads ranks); qkv_proj
  column-parallel by part, o_proj row-parallel. Each rank's KV pool holds only its KV heads (the layer's
  state_spec declares the local count).
- dense MLP: gate_up_proj column-parallel by part, down_proj row-parallel.
- MoE (softmax top-k routing): the router is replicated (every rank routes every token the same way), each
  routed expert is split along its intermediate dim (TPExperts), a shared expert like a dense MLP (its
  sigmoid gate replicated); each part all-reduces its partial sum.
- MLA (DeepSeek): heads split (parallel/tp_mla.py); DeepSeek MoE as MoE above (grouped router replicated,
  shared experts like a dense MLP). With expert parallelism, routed experts are whole on one rank each
  (parallel/expert_parallel.py) instead of split.
- embedding and lm_head: vocab-parallel (rows split; lm_head's logits all-gathered, tied weights stay tied).
- norms, RoPE and everything else: replicated.
- hybrids' mixers (Gated DeltaNet, Mamba-2; gated attention splits like attention) and Nemotron-H's plain
  MLP: parallel/tp_hybrid.py.
- quantized checkpoints (and --quantization): the same split, the storage the checkpoint's config chose
  (parallel/tp_quant.py: each format cuts its own tensors).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from lamina.models.config import ModelConfig
from lamina.models.weight_formats import FormatChoice, Partition, WeightFormat
from lamina.parallel.context import ParallelContext
from lamina.parallel.expert_parallel import expert_format
from lamina.parallel.tp_formats import ColumnParallel, RowParallel, TPExperts
from lamina.parallel.tp_hybrid import HYBRID_FFNS, HYBRID_MIXERS, check_hybrid_config, hybrid_format
from lamina.parallel.tp_mla import MLA_COLUMN, MLA_REPLICATED, shard_mla_heads

SUPPORTED_MIXERS = ("attention", "mla", *HYBRID_MIXERS)  # hybrids' mixers: parallel/tp_hybrid.py
SUPPORTED_FFNS = ("dense", "moe", *HYBRID_FFNS)
_SINGLE_SUBLAYER = ("none",)  # a single-sublayer model's empty halves (Nemotron-H)
_REPLICATED = ("gate", "shared_expert_gate")  # the MoE router and the shared expert's gate
_COLUMN = ("qkv_proj", "gate_up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


def check_tp_config(cfg: ModelConfig, world: int) -> None:
    """Raises ValueError (one line) when `cfg` cannot be split over `world` ranks."""
    if world == 1:
        return
    what = f"--tensor-parallel-size {world}"
    empty = _SINGLE_SUBLAYER if cfg.single_sublayer else ()
    kinds = sorted({s.mixer for s in cfg.layers if s.mixer not in SUPPORTED_MIXERS + empty} |
                   {s.ffn for s in cfg.layers if s.ffn not in SUPPORTED_FFNS + empty})
    if kinds:
        raise ValueError(f"{what}: tensor parallelism does not split {', '.join(kinds)} layers yet (family "
                         f"{cfg.family}; supported: attention, gated attention, Gated DeltaNet and Mamba-2 mixers, "
                         "MLA, dense and plain MLPs, MoE)")
    checks = [("attention heads", cfg.num_heads), ("vocabulary size", cfg.vocab_size),
              ("intermediate size", cfg.intermediate_size), *check_hybrid_config(cfg, world)]
    if cfg.moe is not None:
        checks += [("expert intermediate size", cfg.moe.intermediate_size)]
        if cfg.moe.shared_intermediate_size:
            checks += [("shared expert intermediate size", cfg.moe.shared_intermediate_size)]
        if cfg.moe.shared_experts_intermediate_size:
            checks += [("shared experts intermediate size", cfg.moe.shared_experts_intermediate_size)]
    for name, n in checks:
        if n % world:
            raise ValueError(f"{what}: the model's {name} ({n}) does not divide by {world}")
    kv = cfg.num_kv_heads
    if kv % world and world % kv:
        raise ValueError(f"{what}: the model's {kv} KV heads neither divide by {world} nor divide it "
                         "(each rank needs whole KV heads)")


def check_tp_engine(config: Any, world: int) -> None:
    """Engine settings tensor parallelism does not combine with yet (one line)."""
    what = f"--tensor-parallel-size {world}"
    spec = config.speculative_config
    if spec is not None and spec.method not in ("ngram", "replay"):  # proposers that run no forward of their own
        raise ValueError(f"{what}: speculative decoding method {spec.method!r} with tensor parallelism is not "
                         "supported yet (ngram is)")


def tp_format_choice(ctx: ParallelContext, cfg: ModelConfig) -> FormatChoice:
    """Each layer's tensor-parallel format, by its role (the layer's attribute name); a layer with weights
    that has no role here is refused, so nothing is silently left replicated and wrong."""
    kv = cfg.num_kv_heads
    # Fewer KV heads than ranks: rank r keeps KV head r * kv // world, the one its query heads use.
    kv_part = Partition(ctx.rank * kv // ctx.world, kv, 0) if kv < ctx.world else None
    qkv_parts = {"k": kv_part, "v": kv_part} if kv_part is not None else None

    ep_experts = expert_format(ctx, cfg, ctx.expert_parallel)

    def choose(name: str, module: nn.Module) -> WeightFormat | TPExperts | None:
        role = name.rpartition(".")[2]
        hybrid = hybrid_format(ctx, cfg, name)
        if hybrid is not None:
            return hybrid
        if role == "experts":
            return ep_experts() if ep_experts is not None else TPExperts(ctx)
        if role in _REPLICATED or role in MLA_REPLICATED:
            return None
        if role == "qkv_proj":
            return ColumnParallel(ctx, qkv_parts)
        if role in _COLUMN or role in MLA_COLUMN:
            return ColumnParallel(ctx)
        if role in _ROW:
            return RowParallel(ctx)
        if role in _VOCAB:
            return ColumnParallel(ctx, gather=role == "lm_head")
        raise ValueError(f"tensor parallelism does not split layer {name} ({type(module).__name__}) yet")

    return choose


def shard_heads(model: nn.Module, ctx: ParallelContext) -> None:
    """Sets each attention layer's local head counts (its forward and its KV state spec use them), and the
    hybrid mixers' local sizes and slices (parallel/tp_hybrid.py)."""
    from lamina.models.layers.attention import Attention
    from lamina.models.layers.gated_attention import GatedAttention
    from lamina.parallel.tp_hybrid import shard_state_mixers

    for m in model.modules():
        if isinstance(m, (Attention, GatedAttention)):
            m.num_heads //= ctx.world
            m.num_kv_heads = max(1, m.num_kv_heads // ctx.world)
    shard_state_mixers(model, ctx)
    shard_mla_heads(model, ctx)
