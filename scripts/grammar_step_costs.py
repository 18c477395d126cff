"""The per-step grammar work of structured output alone, on one thread (CPU, ~1 minute): N rows of the bench
schema each following a realistic JSON output (one document, tokenized, each row at its own offset), and per
step the rows' tokens accepted (one batch_accept_token call on raw handles, as fill_pipe.py does) and their
bitmask rows filled (one batch fill, one xgrammar thread). The JSON grammar as the engine compiles it:
whitespace runs bounded in the grammar (compiler.MAX_JSON_WHITESPACE), or, with --ws, also with the bound on
the host (LAMINA_JSON_WHITESPACE_ON_HOST=1: structured/whitespace.py's ban included), interleaved.

  python scripts/grammar_step_costs.py [--rows 1,64] [--steps 200] [--repeats 3] [--ws] [--tokenizer DIR]

Prints, per setting and row count, the median us per step of accept and fill (and ban, with the host bound).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

VOCAB = 151936
ITEM = '{"id": %d, "name": "item %d", "price": %d.5, "tags": ["new", "eco"]}'


def document(n: int = 80) -> str:
    """A valid output of the bench schema, pretty-printed (newlines and indentation: whitespace runs)."""
    items = ",\n    ".join(ITEM % (i, i, i) for i in range(n))
    return '{\n  "items": [\n    ' + items + "\n  ]\n}"


def measure(tok, schema: str, rows: int, steps: int, host_ws: bool) -> dict[str, float]:
    import xgrammar as xg

    from lamina.structured.compiler import GrammarCompilerService
    from lamina.structured.params import StructuredOutputsParams
    from lamina.structured.state import GrammarState
    from lamina.structured.whitespace import ban_long_runs

    os.environ["LAMINA_JSON_WHITESPACE_ON_HOST"] = "1" if host_ws else "0"
    svc = GrammarCompilerService(tok, VOCAB, [tok.eos_token_id])
    compiled = svc.compile(StructuredOutputsParams(json=json.loads(schema)))
    ids = tok(document(), add_special_tokens=False).input_ids
    assert len(ids) > rows * 3 + steps + 10
    states = [GrammarState(compiled, svc.ws_tables) for _ in range(rows)]
    for i, s in enumerate(states):  # row i starts i * 3 tokens in: the rows are in different states
        for t in ids[:i * 3]:
            s.push(t)
        s.flush()
    handles = [s.handle for s in states]
    host = torch.full((rows, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    batch = xg.BatchGrammarMatcher(1)
    out = {"accept": [], "fill": [], "ban": []}
    for step in range(steps):
        toks = [ids[i * 3 + step] for i in range(rows)]
        for s, t in zip(states, toks):
            s.push(t)  # what the read-back does (host_ws: the run kept here)
            s.pending = []
        t0 = time.perf_counter()
        res = xg.base._core.BatchGrammarMatcher.batch_accept_token(handles, toks, False)
        t1 = time.perf_counter()
        batch._handle.batch_fill_next_token_bitmask(handles, host, None, False)
        t2 = time.perf_counter()
        long = [(i, s) for i, s in enumerate(states) if s.ws is not None and s.ws_run >= 8]
        if long:  # PendingMask.result's ban
            ban_long_runs(host, [i for i, _ in long], [s.ws for _, s in long])
        t3 = time.perf_counter()
        assert 0 not in res, step
        for k, v in zip(out, (t1 - t0, t2 - t1, t3 - t2)):
            out[k].append(v * 1e6)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=".gpu/tok" if Path(".gpu/tok").is_dir() else "/work/main/.gpu/tok")
    ap.add_argument("--schema", default="scripts/schemas/bench_items.json")
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ws", action="store_true", help="also the whitespace bound on the host, interleaved")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    schema = Path(args.schema).read_text()
    settings = [False, True] if args.ws else [False]
    for rows in [int(r) for r in args.rows.split(",")]:
        got: dict[bool, list[dict]] = {s: [] for s in settings}
        for _ in range(args.repeats):
            for s in settings:
                got[s].append(measure(tok, schema, rows, args.steps, s))
        for s in settings:
            label = "host bound" if s else "grammar bound"
            parts = "  ".join(f"{k} {statistics.median(r[k] for r in got[s]):7.1f} "
                              f"[{min(r[k] for r in got[s]):.0f}-{max(r[k] for r in got[s]):.0f}]" for k in got[s][0])
            print(f"rows={rows:3d} {label:13s} us/step: {parts}")


if __name__ == "__main__":
    main()
