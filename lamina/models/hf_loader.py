"""Reads an HF model directory: config.json and (sharded) safetensors."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def read_hf_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    hf = json.loads(cfg.read_text())
    # Multimodal checkpoints keep the language model's fields under text_config.
    if "text_config" in hf and "hidden_size" not in hf:
        top = hf
        hf = {**hf["text_config"], "architectures": hf.get("architectures")}
        if "tie_word_embeddings" in top:  # HF ties lm_head by the top-level config's flag
            hf["tie_word_embeddings"] = top["tie_word_embeddings"]
    return hf


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) as stored (the checkpoint's dtype, on the CPU), read one at a time: the parameters'
    loaders convert each into the model's dtype and device as they copy it in, and a format that keeps
    the checkpoint's storage (FP8, packed ints) receives it unconverted."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
