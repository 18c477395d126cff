"""JSON whitespace bounded on the host instead of in the grammar (LAMINA_JSON_WHITESPACE_ON_HOST=1, opt-in).

A JSON grammar with unbounded whitespace lets a small model loop on spaces, so compiler.py bounds each run
(xgrammar's max_whitespace_cnt). xgrammar 0.2.9 compiles that bound as a counted repetition that its token-mask
cache cannot serve: the mean bitmask fill of the bench schema over a realistic output was 24.4 us a row with a
bound of 8 against 6.0 unbounded (1 thread, development machine; scripts/grammar_step_costs.py --ws), and the
fill is most of the host's grammar work per step.

Here the grammar's whitespace is unbounded and the engine ends long runs instead: a sequence's trailing run
of JSON whitespace (space, tab, newline, carriage return) is tracked as its tokens are read back (a table
lookup a token), and once it reaches MAX_RUN characters the tokens that start with whitespace are cleared
from its row after the fill (rare: only rows at the end of a long run pay a row AND). Not the same language
as the grammar's bound: one token may carry a run past MAX_RUN, and runs inside strings count too (a string
cannot hold more than about MAX_RUN spaces in a row). Where the ban would leave a row nothing (a schema that
requires the whitespace), the grammar's row is kept.
"""
from __future__ import annotations

import numpy as np
import torch

from lamina.structured.bitmask import bitmask_width

MAX_RUN = 8  # as compiler.MAX_JSON_WHITESPACE
JSON_WS = b" \t\n\r"


class WhitespaceTables:
    """Per token: how it changes the trailing whitespace run (step: -len for an all-whitespace token, which
    extends the run; else the length of its own trailing whitespace, which restarts it), and `keep`, the
    bitmask row (numpy int32) of the tokens that do not start with whitespace."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        step = [0] * vocab_size
        keep = np.full(bitmask_width(vocab_size), -1, dtype=np.int32)
        bits = keep.view(np.uint32)
        for t, b in enumerate(decoded_vocab[:vocab_size]):
            if not b:
                continue
            body = b.rstrip(JSON_WS)
            step[t] = len(body) - len(b) if not body else len(b) - len(body)
            if b[0] in JSON_WS:
                bits[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        self.step, self.keep = step, keep

    def run_after(self, run: int, tokens) -> int:
        """The trailing whitespace run after `tokens` follow a run of `run` characters."""
        step = self.step
        for t in tokens:
            s = step[t] if 0 <= t < len(step) else 0
            run = run - s if s < 0 else s
        return run


def ban_long_runs(host: torch.Tensor, rows: list[int], tables: list[WhitespaceTables]) -> None:
    """Clears the whitespace-leading tokens from host rows `rows` (each with its tables), in place; a row the
    ban would leave empty keeps the grammar's mask."""
    arr = host.numpy()
    for r, tab in zip(rows, tables):
        row = arr[r]
        banned = row & tab.keep
        if banned.any():
            row[:] = banned
