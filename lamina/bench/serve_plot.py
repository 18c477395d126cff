"""PNG of a `lamina bench serve` concurrency sweep: latency percentiles and throughput vs concurrency."""
from __future__ import annotations

from lamina.bench.serve_stats import RunSummary


def plot_sweep(runs: list[RunSummary], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    runs = [r for r in runs if r.max_concurrency is not None]
    x = [r.max_concurrency for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, (name, attr) in zip(axes, (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"))):
        for pct, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, [getattr(getattr(r, attr), pct) for r in runs], style, label=pct)
        ax.set_title(f"{name} (ms)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())  # plain numbers, not 10^x, on the log axis
    ax = axes[3]
    ax.plot(x, [r.output_throughput for r in runs], "o-", label="output tok/s")
    ax.plot(x, [r.total_token_throughput for r in runs], "s--", label="total tok/s")
    ax.set_title("throughput (tok/s)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel("max concurrency")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
