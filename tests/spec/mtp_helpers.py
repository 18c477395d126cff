"""MTP test pieces: random mtp.* tensors written into a tiny HF checkpoint's safetensors under the published
names, and a plain torch oracle of the MTP head (full recompute over the whole sequence, no cache) built on
HF transformers' own decoder layer and the HF target's hidden states."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from hybrid_helpers import hf_model, make_hybrid_checkpoint
from safetensors.torch import load_file, save_file

FULL_ATTENTION_LAYER = 1  # hybrid_helpers.HYBRID_TYPES: the full-attention layer (the MTP layer's shape)


def _text_cfg(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("text_config", cfg)


def _layer_prefix(names) -> str:
    for prefix in ("model.language_model.layers.", "model.layers."):
        if any(n.startswith(prefix) for n in names):
            return prefix
    raise AssertionError("no decoder layers in the checkpoint")


def make_mtp_checkpoint(path: Path, family: str, tokenizer, seed: int = 0) -> Path:
    """A tiny random checkpoint of `family` (HF save_pretrained) plus random mtp.* tensors: fc, the two
    pre-fc norms, one full-attention decoder layer shaped like the model's (its FFN as the model's
    full-attention layer has it) and the final norm. Written once."""
    make_hybrid_checkpoint(path, family, tokenizer, seed=seed)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    if any(n.startswith("mtp.") for n in tensors):
        return path
    gen = torch.Generator().manual_seed(seed + 1000)
    hidden = _text_cfg(path)["hidden_size"]
    prefix = _layer_prefix(tensors) + f"{FULL_ATTENTION_LAYER}."
    extra = {}
    for name, t in tensors.items():
        if name.startswith(prefix):
            # Norm weights are zero-centred ((1 + w)): small values; matrices at the layer's own scale.
            scale = 0.1 if t.dim() == 1 else float(t.float().std()) or 0.05
            extra["mtp.layers.0." + name[len(prefix):]] = torch.randn(t.shape, generator=gen) * scale
    extra["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        extra[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=gen) * 0.1
    save_file({**tensors, **extra}, str(file), metadata={"format": "pt"})
    return path


def _fuse_experts(state: dict) -> dict:
    """Per-expert checkpoint tensors -> HF's in-memory 3D stacks (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    n = len({k.split(".")[2] for k in state if k.startswith("mlp.experts.") and k.split(".")[2].isdigit()})
    if not n:  # none, or stored stacked already
        return state
    out = {k: v for k, v in state.items() if not k.startswith("mlp.experts.")}
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([state[f"mlp.experts.{e}.gate_proj.weight"],
                                                              state[f"mlp.experts.{e}.up_proj.weight"]])
                                                   for e in range(n)])
    out["mlp.experts.down_proj"] = torch.stack([state[f"mlp.experts.{e}.down_proj.weight"] for e in range(n)])
    return out


class MTPOracle:
    """The head from its definition: rms(embed(t+1)) (1 + w_e) | rms(h_t) (1 + w_h) -> fc -> HF's decoder
    layer (causal over the whole sequence, no cache) -> rms (1 + w_n) -> the target's lm_head."""

    def __init__(self, path: Path) -> None:
        self.hf = hf_model(path)
        lm = self.hf.model.language_model if hasattr(self.hf.model, "language_model") else self.hf.model
        self.lm = lm
        cfg = lm.config
        self.eps = cfg.rms_norm_eps
        layer_cls = type(lm.layers[FULL_ATTENTION_LAYER])
        self.layer = layer_cls(cfg, FULL_ATTENTION_LAYER).float().eval()
        tensors = load_file(str(path / "model.safetensors"))
        state = _fuse_experts({n[len("mtp.layers.0."):]: t for n, t in tensors.items()
                               if n.startswith("mtp.layers.0.")})
        missing, unexpected = self.layer.load_state_dict(state, strict=False)
        assert not unexpected and all("inv_freq" in m for m in missing), (missing, unexpected)
        self.fc = tensors["mtp.fc.weight"].float()
        self.w = {n: tensors[f"mtp.{n}.weight"].float()
                  for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.w[name])

    @torch.no_grad()
    def target_hidden(self, ids: list[int]) -> torch.Tensor:
        """The target's last hidden states (after its final norm) at every position [L, H]."""
        return self.lm(input_ids=torch.tensor([ids])).last_hidden_state[0].float()

    @torch.no_grad()
    def head(self, next_ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Over a whole sequence: index i reads token next_ids[i] and hidden[i] (at position i). Returns
        (the head's normalized output [L, H], logits [L, vocab])."""
        n = len(next_ids)
        e = self.lm.embed_tokens(torch.tensor([next_ids]))[0].float()
        x = torch.cat([self._rms(e, "pre_fc_norm_embedding"), self._rms(hidden, "pre_fc_norm_hidden")], -1) @ self.fc.T
        pos = torch.arange(n)[None]
        cos_sin = self.lm.rotary_emb(x[None], pos)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        g = self._rms(out[0], "norm")
        return g, g @ self.hf.lm_head.weight.float().T

    def drafts(self, ids: list[int], k: int) -> tuple[list[int], torch.Tensor]:
        """The k greedy chained drafts after the known tokens `ids` and their logits [k, vocab], recomputed
        from scratch at every draft."""
        h = self.target_hidden(ids)[:-1]  # hidden states at positions 0 .. T-2
        nxt = list(ids[1:])  # index t reads token t+1
        drafts, logits = [], []
        for _ in range(k):
            g, lg = self.head(nxt, h)
            logits.append(lg[-1])
            drafts.append(int(lg[-1].argmax()))
            nxt.append(drafts[-1])
            h = torch.cat([h, g[-1:]])  # chained: the head's own output at the last index
        return drafts, torch.stack(logits)
