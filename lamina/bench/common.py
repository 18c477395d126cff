"""Helpers every `lamina bench` command shares: the hardware line, the JSON report, freeing the device.

torch is imported inside the functions: the CLI imports this module to build its parser, and a quick start
must not pay for torch."""
from __future__ import annotations

import gc
import json
import os
import platform


def hardware(device) -> str:
    """One line naming what the figures were measured on."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return (f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()} cores, "
            f"torch threads {torch.get_num_threads()}")


def free_device(device) -> None:
    """Returns lamina's weights, KV pool and graph pools before the baseline loads its own."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated(device) / 2**30
        print(f"device memory still allocated before the baseline: {left:.2f} GiB")


def report(result: dict, path: str | None, show: bool = True) -> None:
    """Prints the result as JSON (show) and, with a path, writes it there too."""
    if show:
        print(json.dumps(result, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
