"""Chooses between an op's reference and its GPU implementation."""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    if os.environ.get("LAMINA_DISABLE_TRITON") == "1":
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()
