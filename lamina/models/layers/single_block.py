"""The single-sublayer layer (Nemotron-H's block): norm -> ONE sublayer -> residual.

Nemotron-H has no mixer + FFN pairs: each layer of its pattern is a Mamba-2 mixer, an attention mixer, or an
MLP, each behind its own pre-norm. The sublayer is a mixer (held as `self_attn`, so the model's
state_layers() finds it) where the LayerSpec's mixer is not "none", else the LayerSpec's FFN (held as `mlp`).

Like DecoderLayer it carries the residual separately and fuses each residual add into the next norm: it takes
and returns (hidden, residual) with hidden + residual = the HF block's output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lamina.kernels.metadata import StepContext
from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers.linear import Linear
from lamina.models.layers.norm import RMSNorm
from lamina.models.layers.rope_table import RopeTable


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# HF activation names -> the elementwise activation of a plain (ungated) MLP.
PLAIN_ACTS = {"relu2": _relu2, "relu": F.relu, "silu": F.silu, "gelu": F.gelu}


class PlainMLP(nn.Module):
    """down(act(up(x))): the ungated feed-forward (Nemotron-H's relu2 MLP). Names: up_proj, down_proj."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        if act not in PLAIN_ACTS:
            raise ValueError(f"unsupported MLP activation {act!r}; supported: {', '.join(PLAIN_ACTS)}")
        self.act = PLAIN_ACTS[act]
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class SingleSublayerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rope: RopeTable) -> None:
        super().__init__()
        from lamina.models.layers.decoder import build_ffn, build_mixer  # decoder imports the layer kinds

        if (spec.mixer == "none") == (spec.ffn == "none"):
            raise ValueError(f"a single-sublayer layer holds a mixer or an FFN, got {spec.mixer!r} + {spec.ffn!r}")
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        if spec.mixer != "none":
            self.self_attn = build_mixer(cfg, spec, rope)
        else:
            self.mlp = build_ffn(cfg, spec)
        self.is_mixer = spec.mixer != "none"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.norm(x)
        else:
            x, residual = self.norm(x, residual)
        return (self.self_attn(x, positions, ctx) if self.is_mixer else self.mlp(x)), residual
