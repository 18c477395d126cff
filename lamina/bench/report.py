"""What every `lamina bench` command shares: naming the hardware and reporting a result."""
from __future__ import annotations

import json
import os
import platform


def hardware(device) -> str:
    """The device a figure was measured on, in words."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return (f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()} cores, "
            f"torch threads {torch.get_num_threads()}")


def report(result: dict, path: str | None, show: bool = True) -> None:
    """Prints the result as JSON (show) and writes it to path (if given)."""
    if show:
        print(json.dumps(result, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
