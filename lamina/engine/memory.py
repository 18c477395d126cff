"""Device/dtype choice and KV pool sizing."""
from __future__ import annotations

import logging

import torch

from lamina.config import EngineConfig

log = logging.getLogger("lamina")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def plan_kv_blocks(cfg: EngineConfig, bytes_per_block: int, device: torch.device,
                   profile_peak_bytes: int = 0) -> int:
    """Number of KV blocks: explicit count, explicit budget, or (CUDA) what is left after weights and a
    profiled worst-case step, times gpu_memory_utilization."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_memory_gb is not None:
        budget = int(cfg.kv_cache_memory_gb * 2**30)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cfg.gpu_memory_utilization) - used - profile_peak_bytes
    else:
        budget = 2 * 2**30
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB); "
                         "raise gpu_memory_utilization or kv_cache_memory_gb")
    return blocks


SNAPSHOT_MEMORY_FRACTION = 0.1  # of device memory, for the default number of state snapshots


def default_num_snapshots(max_num_seqs: int, bytes_per_snapshot: int, device_memory: int | None) -> int:
    """Two snapshots per sequence slot, but at most SNAPSHOT_MEMORY_FRACTION of device memory: one snapshot
    of a big hybrid model is tens of MB (Qwen3-Next-80B: ~77 MB), so 2 x 256 would take ~39 GB from the
    KV cache. device_memory None (CPU): no cap."""
    n = 2 * max_num_seqs
    if device_memory is not None and bytes_per_snapshot > 0:
        n = min(n, int(device_memory * SNAPSHOT_MEMORY_FRACTION) // bytes_per_snapshot)
    return max(1, n)
