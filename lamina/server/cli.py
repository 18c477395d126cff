"""`lamina serve` (placeholder until the server lands)."""
from __future__ import annotations


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server")
    p.set_defaults(func=lambda args: print("not yet implemented") or 1)
