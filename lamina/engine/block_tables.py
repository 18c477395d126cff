"""Block tables of the running sequences, kept as one persistent row each on the host and on the device.

A sequence keeps its row from its first step until its row is needed for another (rows of sequences no
longer running are reclaimed lazily). Each step only the entries that changed travel: a sequence that is new
to its row, or whose table was replaced (preemption, a prefix-cache match), sends its whole table; one that
grew sends its new blocks. The host mirror is what slot mappings are computed from; the device table is
what the step's [B, width] block tables are gathered from. `attr` names the sequence's table these rows
mirror (the window group's is `window_table`, cache/kv_groups.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from lamina.engine.request import SeqStatus, Sequence


@dataclass
class _Row:
    seq: Sequence
    table: list[int]  # the list object last synced (a replaced table is a new list)
    synced: int  # entries of it already in the row


class BlockTables:
    def __init__(self, device: torch.device, attr: str = "block_table") -> None:
        self.device, self.attr = device, attr
        self.host = np.zeros((0, 0), np.int32)
        self.table = torch.zeros(0, 0, dtype=torch.int32, device=device)
        self._rows: dict[int, int] = {}  # seq_id -> row
        self._owner: list[_Row | None] = []
        self._free: list[int] = []  # rows without an owner, lowest last

    def _grow(self, rows: int, width: int) -> None:
        r0, w0 = self.host.shape
        rows, width = max(rows, r0), max(width, w0)
        if (rows, width) == (r0, w0):
            return
        rows = max(rows, 2 * r0) if rows > r0 else rows
        width = max(width, 2 * w0) if width > w0 else width
        host = np.zeros((rows, width), np.int32)
        host[:r0, :w0] = self.host
        table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        table[:r0, :w0] = self.table
        self.host, self.table = host, table
        self._owner += [None] * (rows - r0)
        self._free = list(range(rows - 1, r0 - 1, -1)) + self._free

    def _free_row(self) -> int:
        if not self._free:  # reclaim the rows of sequences that stopped running
            for r, owner in enumerate(self._owner):
                if owner is not None and owner.seq.status != SeqStatus.RUNNING:
                    # The id may point at a newer row already (a sequence that came back, or a drafter's
                    # copy with the target's id): drop the mapping only if it is this row's.
                    if self._rows.get(owner.seq.seq_id) == r:
                        del self._rows[owner.seq.seq_id]
                    self._owner[r] = None
                    self._free.append(r)
            self._free.reverse()
        if not self._free:
            self._grow(len(self._owner) + 1, 0)
        return self._free.pop()

    def update(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows of `seqs` (this step's sequences, in order), after updating the host mirror; and the changed
        entries as (flat index into the device table, block id) for apply()."""
        tables = list(map(attrgetter(self.attr), seqs))
        self._grow(len(seqs), max(map(len, tables)))
        rows_get, owners, host = self._rows.get, self._owner, self.host
        w = host.shape[1]
        rows: list[int] = []
        flat: list[int] = []
        vals: list[int] = []
        # Runs per sequence between a verify step's read-back and the next launch: the usual sequence kept its
        # row and table and grew by nothing or a block, so only that is looked at.
        for seq, table in zip(seqs, tables):
            r = rows_get(seq.seq_id)
            if r is None or owners[r].seq is not seq:
                r = self._free_row()
                host = self.host  # _free_row may have grown it (same width)
                self._rows[seq.seq_id] = r
                owners[r] = _Row(seq, table, 0)
            rec = owners[r]
            if rec.table is not table:
                rec.table, rec.synced = table, 0
            synced = rec.synced
            if synced < len(table):
                new = table[synced:]
                host[r, synced:len(table)] = new
                flat += range(r * w + synced, r * w + len(table))
                vals += new
                rec.synced = len(table)
            rows.append(r)
        return np.array(rows, np.int64), np.asarray(flat, np.int64), np.asarray(vals, np.int32)

    def apply(self, flat: torch.Tensor, vals: torch.Tensor) -> None:
        """Writes the changed entries (device copies of update()'s) into the device table."""
        if flat.shape[0]:
            self.table.view(-1).index_copy_(0, flat, vals)

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The step's block tables [B, width] (entries past a sequence's own blocks are stale, never read)."""
        return self.table[:, :width].index_select(0, rows)
