"""The one model loop: embed -> decoder layers -> final norm -> lm_head on the rows that are sampled."""
from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.metadata import StepContext
from lamina.kernels.rope import rope_cos_sin_cache, rope_inv_freq
from lamina.models.config import ModelConfig
from lamina.models.layers.decoder import DecoderLayer
from lamina.models.layers.norm import RMSNorm


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec) for spec in cfg.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


class CausalLM(nn.Module):
    """Parameter names follow HF's (model.layers.N.self_attn...), so checkpoints map by name."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, max_positions: int) -> None:
        """Builds the shared cos/sin table (fp32, on the weights' device) once, after loading."""
        cfg = self.config
        inv_freq, factor = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        cache = rope_cos_sin_cache(inv_freq, max_positions, factor).to(self.lm_head.weight.device)
        for layer in self.model.layers:
            if hasattr(layer.self_attn, "cos_sin_cache"):
                layer.self_attn.cos_sin_cache = cache

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      ctx: StepContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, ctx)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                logits_indices: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, positions, ctx)
        return self.compute_logits(hidden.index_select(0, logits_indices))
