"""What the GPU benches share: the relative error of an output against its reference, and the median time
of a call from CUDA-graph replays (so launch overhead is not what is timed)."""
from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def time_us(fn, copies: int = 1, reps: int = 20) -> float:
    """Median microseconds of fn(i) over CUDA-graph replays of `copies` calls (i rotates weight copies so
    each call reads them cold)."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / copies)
    return sorted(samples)[len(samples) // 2]
