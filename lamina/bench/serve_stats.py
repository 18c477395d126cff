"""Aggregates per-request results of `lamina bench serve` into throughput and latency percentiles."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from lamina.bench.serve_client import RequestResult


@dataclass
class Dist:
    """A latency distribution in milliseconds."""
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Dist:
        if not seconds:
            return cls(float("nan"), float("nan"), float("nan"), float("nan"))
        a = np.asarray(seconds) * 1000.0
        return cls(float(a.mean()), *(float(np.percentile(a, q)) for q in (50, 90, 99)))


@dataclass
class RunSummary:
    max_concurrency: int | None
    request_rate: float
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    ttft_ms: Dist
    tpot_ms: Dist  # per request: (latency - ttft) / (output tokens - 1)
    itl_ms: Dist  # gaps between streamed chunks (one chunk may carry several tokens)
    e2el_ms: Dist
    errors: list[str]
    server_counters: dict[str, float] = field(default_factory=dict)  # server-side deltas over the run
    num_clients: int = 1  # client processes that shared the run
    # Each client process's CPU seconds over the run / the run's duration: near 1.0, that client was saturated.
    client_cpu_frac: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain JSON: inf/NaN (unlimited rate, empty distributions) become "inf"/null."""
        def clean(v):
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, float) and not math.isfinite(v):
                return "inf" if v == math.inf else None
            return v
        return clean(asdict(self))


def summarize(results: list[RequestResult], duration: float, max_concurrency: int | None,
              request_rate: float) -> RunSummary:
    ok = [r for r in results if r.ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return RunSummary(
        max_concurrency=max_concurrency, request_rate=request_rate, duration_s=duration, completed=len(ok),
        failed=len(results) - len(ok), total_input_tokens=n_in, total_output_tokens=n_out,
        request_throughput=len(ok) / duration, output_throughput=n_out / duration,
        total_token_throughput=(n_in + n_out) / duration, ttft_ms=Dist.of([r.ttft for r in ok]),
        tpot_ms=Dist.of(tpots), itl_ms=Dist.of([x for r in ok for x in r.itl]),
        e2el_ms=Dist.of([r.latency for r in ok]), errors=errors[:10])


def format_summary(s: RunSummary) -> str:
    conc = "unlimited" if s.max_concurrency is None else str(s.max_concurrency)
    lines = [f"{'=' * 18} Serving benchmark (max concurrency {conc}) {'=' * 18}",
             f"{'Successful requests:':<40}{s.completed:>12}",
             f"{'Failed requests:':<40}{s.failed:>12}",
             f"{'Request rate (req/s):':<40}{s.request_rate:>12}",
             f"{'Benchmark duration (s):':<40}{s.duration_s:>12.2f}",
             f"{'Total input tokens:':<40}{s.total_input_tokens:>12}",
             f"{'Total generated tokens:':<40}{s.total_output_tokens:>12}",
             f"{'Request throughput (req/s):':<40}{s.request_throughput:>12.2f}",
             f"{'Output token throughput (tok/s):':<40}{s.output_throughput:>12.2f}",
             f"{'Total token throughput (tok/s):':<40}{s.total_token_throughput:>12.2f}"]
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E latency", s.e2el_ms)):
        lines.append(f"{name + ' (ms)':<18}mean {d.mean:>10.1f}  p50 {d.p50:>10.1f}  p90 {d.p90:>10.1f}  "
                     f"p99 {d.p99:>10.1f}")
    if s.client_cpu_frac:
        label = "Client processes, busiest CPU fraction:"
        lines.append(f"{label:<40}{s.num_clients:>5} {max(s.client_cpu_frac):>6.2f}")
    for k, v in sorted(s.server_counters.items()):
        lines.append(f"{'server ' + k.split(':', 1)[-1] + ':':<40}{v:>12g}")
    for e in s.errors:
        lines.append(f"error: {e}")
    return "\n".join(lines)
