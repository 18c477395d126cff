#!/usr/bin/env python3
"""Writes a GPTQ (v1, 4-bit) checkpoint of a dense `random:` preset's shape with random integers, scales
and zero points, streamed layer by layer (no dense copy is ever built), so the W4A16 decode target can be
measured at model level next to the bf16 preset in one session:

    python scripts/write_gptq_checkpoint.py qwen3-8b /tmp/qwen3-8b-gptq [--group 128] [--act-order] \
        [--tokenizer DIR]
    lamina bench latency --model random:qwen3-8b --input-len 128 --output-len 256      # bf16
    lamina bench latency --model /tmp/qwen3-8b-gptq --input-len 128 --output-len 256   # W4A16

Needs the loader to read config.json's quantization_config (merged with the FP8 branch's wiring). Without
--tokenizer the directory has no tokenizer: pass `--tokenizer` to lamina (any tokenizer whose ids cover the
prompts; the latency bench uses token-id prompts).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from lamina.bench.checkpoint import TOKENIZER_FILES, random_hf_config  # noqa: E402


def gptq_linear(n: int, k: int, group: int, act_order: bool, gen: torch.Generator) -> dict[str, torch.Tensor]:
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return {"qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32),
            "qzeros": torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32),  # z = 8 (stored 7)
            "scales": (torch.rand(k // group, n, generator=gen) * 2e-3 + 5e-4).half(),
            "g_idx": g_idx.int()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("out")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--tokenizer", default=None)
    args = ap.parse_args()
    cfg = random_hf_config(args.preset.removeprefix("random:")).to_dict()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    gen = torch.Generator().manual_seed(0)
    bf = lambda *shape: (torch.randn(*shape, generator=gen) * 0.02).bfloat16()  # noqa: E731
    index: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        save_file(tensors, str(out / name))
        index.update(dict.fromkeys(tensors, name))

    save({"model.embed_tokens.weight": bf(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
          **({} if cfg.get("tie_word_embeddings") else {"lm_head.weight": bf(v, h)})}, "embed.safetensors")
    projs = {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h), "self_attn.v_proj": (kv * d, h),
             "self_attn.o_proj": (h, heads * d), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
             "mlp.down_proj": (h, inter)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t = {f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
        if cfg.get("model_type") == "qwen3":
            t[f"{p}.self_attn.q_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
            t[f"{p}.self_attn.k_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        orders: dict[int, torch.Tensor] = {}
        for name, (n, k) in projs.items():
            q = gptq_linear(n, k, args.group, args.act_order, gen)
            if name != "self_attn.o_proj" and name != "mlp.down_proj":  # q|k|v and gate|up share one order
                q["g_idx"] = orders.setdefault(k, q["g_idx"]).clone()
            t.update({f"{p}.{name}.{s}": x for s, x in q.items()})
        save(t, f"layer{i:03d}.safetensors")
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": args.group,
                                  "desc_act": args.act_order, "sym": True, "checkpoint_format": "gptq"}
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    if args.tokenizer:
        for f in TOKENIZER_FILES:
            if (Path(args.tokenizer) / f).is_file():
                shutil.copy(Path(args.tokenizer) / f, out / f)
    print(f"wrote {args.preset} as GPTQ int4 g{args.group} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
