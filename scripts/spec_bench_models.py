"""The models scripts/gpu_spec_bench.py runs (random presets, cut to fewer layers) and where (the H200, or the
CPU under --cpu-smoke), shared by its check stages and its forced-acceptance stages (spec_forced_stage.py)."""
from __future__ import annotations

import gc
import os

DENSE, HYBRID = "qwen3-8b", "qwen3-next-80b-a3b-24l"
K = 3
TARGET_VERIFY = {"dense": 1.15, "hybrid": 1.25}  # verify forward over decode forward at batch 1, at most
SMOKE = {DENSE: "tiny-llama", HYBRID: "tiny-qwen3-next"}  # --smoke: toy presets on the CPU


def cut(name: str, layers: int | None) -> str:
    """A random preset, cut to `layers` layers (registered in this process only)."""
    from lamina.models import presets

    if os.environ.get("SPEC_BENCH_SMOKE") == "1":
        name, layers = SMOKE[name], None
    if not layers or layers >= presets.PRESETS[name]["num_hidden_layers"]:
        return f"random:{name}"
    presets.PRESETS[f"{name}-{layers}l"] = dict(presets.PRESETS[name], num_hidden_layers=layers)
    return f"random:{name}-{layers}l"


def device_args() -> list[str]:
    """The CLI's device flags: the CPU under --cpu-smoke, else none (the GPU)."""
    return ["--device", "cpu"] if os.environ.get("SPEC_BENCH_SMOKE") == "1" else []


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
