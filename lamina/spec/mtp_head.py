"""The multi-token-prediction (MTP) head shipped inside Qwen3-Next and Qwen3.5 checkpoints (`mtp.*` tensors).

At position t it reads the embedding of token t+1 and the target model's last hidden state at t (after the
target's final norm), RMS-normalizes each (pre_fc_norm_embedding, pre_fc_norm_hidden), concatenates them
[embedding | hidden], projects 2H -> H (fc), runs one full-attention decoder layer (gated attention, with the
model's MoE or dense FFN as its checkpoint stores it), normalizes (norm) and scores with the target's lm_head;
the embedding table is the target's too. Its logits at t guess token t+2. Chained for K > 1: the head's own
normalized output at t stands in for the target's hidden state at t+1, with the drafted token.

Checkpoint names: mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*, mtp.norm (the
prefix dropped, they are this module's parameter names). Only one MTP layer is supported (what Qwen ships).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from torch import nn

from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers.decoder import DecoderLayer
from lamina.models.layers.linear import Linear
from lamina.models.layers.norm import RMSNorm
from lamina.models.layers.rope_table import RopeTable

MTP_PREFIXES = ("mtp.", "model.mtp.")


class MTPHead(nn.Module):
    """The head's own weights; embed and lm_head are the target's (passed to forward / logits)."""

    def __init__(self, cfg: ModelConfig, ffn: str, rope: RopeTable) -> None:
        super().__init__()
        spec = LayerSpec("gated_attention", ffn)
        # The runner reads config.layers (the reference attention's windows); tying is the target's business.
        self.config = dataclasses.replace(cfg, layers=[spec], tie_word_embeddings=False)
        h, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.pre_fc_norm_embedding = RMSNorm(h, eps, off)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, off)
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, spec, rope)])
        self.norm = RMSNorm(h, eps, off)

    @property
    def kv_layers(self) -> list[nn.Module]:
        """The layers whose KV the proposer keeps (budgeted with the target's pool: engine/build.py)."""
        return [self.layers[0].self_attn]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """embeds [T, H]: the target's embeddings of tokens t+1; hidden [T, H]: hidden states at t (the target's
        or, chained, this head's output). Returns this head's normalized output [T, H] (lm_head scores it)."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x, residual = self.layers[0](self.fc(x), None, positions, ctx)
        x, _ = self.norm(x, residual)
        return x


def mtp_tensor_names(model: str) -> list[str]:
    """Names of the multi-token-prediction tensors (mtp.*) an HF checkpoint directory stores ([] for none,
    and for GGUF files, built-in names and random presets)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return []
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        names = []
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names += list(f.keys())
    return [n for n in names if n.startswith(MTP_PREFIXES)]


def _strip(name: str) -> str:
    for prefix in MTP_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def check_mtp_names(names: list[str]) -> str:
    """The FFN kind of the head's layer ("moe" or "dense") from its tensor names; ValueError (one line) for
    a layout this head does not implement."""
    layers = {int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", _strip(n)))}
    if layers != {0}:
        raise ValueError(f"speculative_config: method 'mtp' supports one MTP layer; the checkpoint has "
                         f"{len(layers)} ({sorted(layers)[:4]})")
    return "moe" if any(_strip(n).startswith("layers.0.mlp.experts") for n in names) else "dense"


def _iter_mtp_tensors(model: str):
    """(name, tensor) of the mtp.* tensors only, reading just the files that hold them."""
    from safetensors import safe_open

    path = Path(model).expanduser()
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wmap = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for n, f in wmap.items() if n.startswith(MTP_PREFIXES)})
    else:
        files = sorted(path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.startswith(MTP_PREFIXES):
                    yield name, f.get_tensor(name)


def load_mtp_head(model_path: str, cfg: ModelConfig, rope: RopeTable, dtype: torch.dtype,
                  device: torch.device) -> MTPHead:
    """The head with the checkpoint's mtp.* weights (dense formats; built on meta, then filled)."""
    from lamina.models.families.qwen3_next import mtp_checkpoint_map
    from lamina.models.loader import _finalize
    from lamina.models.weights import load_weights

    ffn = check_mtp_names(mtp_tensor_names(model_path))
    if ffn == "moe" and cfg.moe is None:
        raise ValueError("speculative_config: the checkpoint's MTP layer is MoE but the model config has no experts")
    with torch.device("meta"):
        head = MTPHead(cfg, ffn, rope)
    head = head.to(dtype).to_empty(device=device)
    load_weights(head, _iter_mtp_tensors(model_path), mtp_checkpoint_map(cfg))
    return _finalize(head).eval()
