"""`lamina bench` (placeholder)."""
from __future__ import annotations


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    p.set_defaults(func=lambda args: print("not yet implemented") or 1)
