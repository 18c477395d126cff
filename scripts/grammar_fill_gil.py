"""Which of xgrammar's bitmask fills release the interpreter lock: a pure-Python counter thread runs while
the main thread fills rows; the counter can only advance during a fill call if the call released the lock.
Per single-matcher call and per batch call (1, 2 threads): mean call time, the counter's mean advance within
a call, and how many calls let it advance not at all. CPU only, ~1 minute.

  python scripts/grammar_fill_gil.py [--tokenizer DIR] [--rows 64]
"""
from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=".gpu/tok" if Path(".gpu/tok").is_dir() else "/work/main/.gpu/tok")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--schema", default="scripts/schemas/bench_items.json")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import xgrammar as xg
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    info = xg.TokenizerInfo.from_huggingface(tok, vocab_size=151936)
    compiled = xg.GrammarCompiler(info).compile_json_schema(Path(args.schema).read_text())
    prefix = tok('{"items": [{"id": 1, "name": "abc', add_special_tokens=False).input_ids  # inside a string
    matchers = [xg.GrammarMatcher(compiled) for _ in range(args.rows)]
    for m in matchers:
        for t in prefix:
            assert m.accept_token(t)
    bitmask = xg.allocate_token_bitmask(args.rows, 151936)
    count, stop = [0], [False]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)

    def timed(fn) -> tuple[float, int]:
        c0, t0 = count[0], time.perf_counter()
        fn()
        return time.perf_counter() - t0, count[0] - c0

    batches = {n: xg.BatchGrammarMatcher(n) for n in (1, 2)}
    try:
        for _ in range(2):
            calls = [timed(lambda i=i, m=m: m.fill_next_token_bitmask(bitmask, i))
                     for _ in range(args.reps) for i, m in enumerate(matchers)]
            _report(f"GrammarMatcher.fill_next_token_bitmask, {args.rows} rows one call each", calls)
            for n, b in batches.items():
                calls = [timed(lambda b=b: b.batch_fill_next_token_bitmask(matchers, bitmask))
                         for _ in range(args.reps)]
                _report(f"BatchGrammarMatcher({n}).batch_fill_next_token_bitmask, {args.rows} rows", calls)
    finally:
        stop[0] = True
        th.join()


def _report(name: str, calls: list[tuple[float, int]]) -> None:
    n = len(calls)
    mean_us = sum(d for d, _ in calls) / n * 1e6
    adv = sum(c for _, c in calls) / n
    none = sum(c == 0 for _, c in calls)
    rate = sum(c for _, c in calls) / max(sum(d for d, _ in calls), 1e-9) / 1e6
    print(f"{name}: {n} calls, {mean_us:.0f} us each, counter +{adv:.0f} a call ({rate:.2f} M/s), "
          f"{none} calls with no advance")


if __name__ == "__main__":
    main()
