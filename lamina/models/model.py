"""The one model loop: embed -> decoder layers -> final norm -> lm_head on the rows that are sampled."""
from __future__ import annotations

import torch
from torch import nn

from lamina.cache.specs import Stateful
from lamina.kernels.metadata import StepContext
from lamina.models.config import ModelConfig
from lamina.models.layers.decoder import DecoderLayer
from lamina.models.layers.linear import Embedding, Linear
from lamina.models.layers.norm import RMSNorm
from lamina.models.layers.rope_table import RopeTable


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        # One RoPE table for the whole model, handed to the layers that rotate (filled after loading).
        self.rope = RopeTable(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, self.rope) for spec in cfg.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


class CausalLM(nn.Module):
    """Parameter names follow HF's (model.layers.N.self_attn...), so checkpoints map by name."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def init_rope(self, max_positions: int) -> None:
        """Builds the shared cos/sin table (fp32, on the weights' device) once, after loading."""
        self.model.rope.build(max_positions, self.lm_head.weight.device)

    def state_layers(self) -> list[Stateful]:
        """The mixers, in layer order: each declares its per-sequence state (state_spec, None for none) and
        takes the views the engine allocates for it (bind_state); see cache/specs.py."""
        return [layer.self_attn for layer in self.model.layers]

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
