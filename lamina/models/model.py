"""The one model loop: embed -> decoder layers -> final norm -> lm_head on the rows that are sampled."""
from __future__ import annotations

import json

import torch
from torch import nn

from lamina.cache.specs import Stateful
from lamina.kernels.metadata import StepContext
from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers.decoder import DecoderLayer
from lamina.models.layers.linear import Embedding, Linear
from lamina.models.layers.norm import RMSNorm
from lamina.models.layers.rope_table import RopeTable
from lamina.models.layers.sandwich_decoder import SandwichDecoderLayer
from lamina.models.layers.single_block import SingleSublayerLayer


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        # One RoPE table per distinct (base, scaling) the layers use (Gemma 3: local and global), shared by
        # the layers that rotate with it (filled after loading).
        self.rope = RopeTable(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.ropes = {_rope_key(cfg.rope_theta, cfg.rope_scaling): self.rope}
        for spec in cfg.layers:
            if spec.rope_theta is not None:
                key = _rope_key(spec.rope_theta, spec.rope_scaling)
                self.ropes.setdefault(key, RopeTable(cfg.rotary_dim, spec.rope_theta, spec.rope_scaling))
        layer_cls = SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer
        if cfg.single_sublayer:
            layer_cls = SingleSublayerLayer
        self.layers = nn.ModuleList(layer_cls(cfg, spec, self._rope_of(cfg, spec)) for spec in cfg.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.embed_scale = cfg.embed_scale

    def _rope_of(self, cfg: ModelConfig, spec: LayerSpec) -> RopeTable:
        if spec.rope_theta is None:
            return self.rope
        return self.ropes[_rope_key(spec.rope_theta, spec.rope_scaling)]


def _rope_key(theta: float, scaling: dict | None) -> str:
    return json.dumps([theta, scaling], sort_keys=True)


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
        for rope in self.model.ropes.values():
            rope.build(max_positions, self.lm_head.weight.device)

    def state_layers(self) -> list[Stateful]:
        """The mixers, in layer order: each declares its per-sequence state (state_spec, None for none) and
        takes the views the engine allocates for it (bind_state); see cache/specs.py."""
        return [layer.self_attn for layer in self.model.layers if hasattr(layer, "self_attn")]  # not FFN-only

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      ctx: StepContext, layers: tuple[int, ...] | None = None) -> torch.Tensor:
        """layers: the decoder layers to run, in order (None: all); self_spec's drafter runs a subset."""
        x = self.model.embed_tokens(input_ids)
        if self.model.embed_scale is not None:
            # HF multiplies by the scale rounded to the model dtype (sqrt(640) is 25.25 in bf16, not 25.30).
            x = x * torch.tensor(self.model.embed_scale, dtype=x.dtype).item()
        residual = None
        for layer in self.model.layers if layers is None else [self.model.layers[i] for i in layers]:
            x, residual = layer(x, residual, positions, ctx)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcap
        # Capped in fp32 (HF caps in the model dtype; the cap only bends logits near +-cap).
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                logits_indices: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, positions, ctx)
        return self.compute_logits(hidden.index_select(0, logits_indices))
