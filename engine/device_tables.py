"""Block tables that live on the device, updated by the diff each step's upload carries.

A sequence's block table changes by at most a block or two a step (a new block every `block_size`
tokens, the partial block replaced by copy on write), so re-sending every table whole each step
would carry mostly what the device already holds. Each sequence in a step has a row of a device
tensor; the host keeps a mirror of what each row holds and uploads only the entries that differ,
as (row, column, block) triples, plus the row of each of the step's sequences. The device writes the
triples and gathers the step's tables from the rows (`step_tables`).

A row belongs to a sequence for as long as the sequence is in consecutive steps; a row whose sequence
was not in a step is free for the next one, which rewrites whatever of it differs (stale entries past
the new table are reset to -1). Entries past a table's end are never read for attention (the kernels
dereference only a context's blocks); resetting them keeps every row equal to its mirror.

A steady decode step (the previous step's sequences, in its order) keeps every row without a lookup,
finds the few rows that differ in one pass in C, and, when none does, uploads nothing for its tables:
the tables gathered for the previous step serve again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from operator import ne

import torch

from engine.bridge import Upload

DIFF, ROWS = "tables.diff", "tables.rows"
PAD_BLOCK = -1


@dataclass(slots=True)
class TablePlan:
    """What `DeviceBlockTables.pack` put in a step's upload."""

    width: int  # columns of the step's tables: its widest table
    diffs: int  # (row, column, block) triples
    unchanged: bool = False  # the previous step's rows, width and entries: nothing uploaded, its tables serve again


@dataclass(slots=True)
class DeviceBlockTables:
    device: torch.device
    max_blocks_per_seq: int
    tables: torch.Tensor = field(init=False)  # [rows, max_blocks_per_seq] int32 on the device
    mirror: list[list[int]] = field(default_factory=list)  # what each device row holds (entries up to its length)
    row_of: dict[int, int] = field(default_factory=dict)  # seq id -> row, for the sequences of the latest step
    seq_ids: list[int] = field(default_factory=list)  # the latest step's sequences, in its order
    rows: list[int] = field(default_factory=list)  # and their rows
    held: list[list[int]] = field(default_factory=list)  # the mirror's lists of those rows, in step order
    width: int = 0  # the latest step's widest table
    gathered: torch.Tensor | None = None  # the latest step's tables, as `step_tables` gathered them
    unapplied: list[int] = field(default_factory=list)  # rows whose diff is packed but not yet written
    unknown: list[int] = field(init=False)  # a mirror entry for a row of unknown content: every column differs

    def __post_init__(self) -> None:
        self.tables = torch.full((0, self.max_blocks_per_seq), PAD_BLOCK, dtype=torch.int32, device=self.device)
        self.unknown = [PAD_BLOCK - 1] * self.max_blocks_per_seq  # no block id

    def pack(self, upload: Upload, seq_ids: list[int], block_tables: list[list[int]]) -> TablePlan:
        """Adds the step's rows and the entries that differ from what the device holds to `upload`."""
        self._forget_unapplied()
        # A steady decode step runs the sequences of the previous one, in the same order: same rows.
        kept = seq_ids == self.seq_ids
        if not kept:
            self._assign(seq_ids)
        rows = self.rows
        # Which rows differ, compared in C (map, compress): in a decode step few do (a new block every
        # `block_size` tokens, a copy on write), so the per-row work of `_diff` is for those only.
        changed = list(compress(range(len(rows)), map(ne, self.held, block_tables)))
        diffs: list[int] = []
        for index in changed:
            self._diff(rows[index], block_tables[index], diffs)
        width = max(map(len, block_tables))
        if kept and not diffs and width == self.width and self.gathered is not None:
            return TablePlan(width, 0, unchanged=True)  # the device has nothing to write or gather
        self.gathered, self.width = None, width
        self.unapplied = [rows[index] for index in changed]
        upload.add(ROWS, rows, torch.int32)  # row numbers fit; index_select takes int32 ids
        upload.add(DIFF, diffs, torch.int64, (len(diffs) // 3, 3))
        return TablePlan(width, len(diffs) // 3)

    def step_tables(self, plan: TablePlan, views: dict[str, torch.Tensor]) -> torch.Tensor:
        """Writes the diff into the device rows and returns the step's tables [seqs, width]: a new tensor, or
        the previous step's when nothing changed (nobody writes into it)."""
        if plan.unchanged:
            return self.gathered  # read only, by attention and the graphs' copy
        if plan.diffs:
            rows, columns, blocks = views[DIFF].t()
            self.tables.index_put_((rows, columns), blocks.to(torch.int32))
        self.unapplied = []
        self.gathered = self.tables.index_select(0, views[ROWS])[:, : plan.width]
        return self.gathered

    def _forget_unapplied(self) -> None:
        """A step packed but never run (it failed before its tables were gathered) left its diff unwritten:
        what those rows hold is no longer known, so they are rewritten whole when next used."""
        for row in self.unapplied:
            self.mirror[row][:] = self.unknown
        self.unapplied = []

    def _assign(self, seq_ids: list[int]) -> None:
        """Keeps the rows of sequences that were in the previous step; gives the others the rows left free."""
        if len(seq_ids) > len(self.mirror):
            self._grow(len(seq_ids))
        previous = self.row_of
        rows = [previous.get(seq_id, -1) for seq_id in seq_ids]
        if -1 in rows:  # -1: a sequence not in the previous step
            free = sorted(set(range(len(self.mirror))).difference(rows), reverse=True)  # lowest rows first
            rows = [free.pop() if row == -1 else row for row in rows]
        self.row_of = dict(zip(seq_ids, rows))
        self.seq_ids, self.rows = list(seq_ids), rows
        self.held = [self.mirror[row] for row in rows]  # the very lists `_diff` updates in place

    def _grow(self, rows: int) -> None:
        # Doubling: a step with more sequences than ever before reallocates, a handful of times in all.
        old = len(self.mirror)
        new = max(8, 2 * old)
        while new < rows:
            new *= 2
        grown = torch.full((new, self.max_blocks_per_seq), PAD_BLOCK, dtype=torch.int32, device=self.device)
        grown[:old].copy_(self.tables)
        self.tables = grown
        self.mirror += [[] for _ in range(new - old)]

    def _diff(self, row: int, table: list[int], diffs: list[int]) -> None:
        held = self.mirror[row]  # differs from table (`pack` diffs only those)
        # Usually the table grew by a block or its last block was replaced: only the tail differs.
        start = 0
        if len(held) <= len(table) and held[:-1] == table[: len(held) - 1]:
            start = max(len(held) - 1, 0)
        for column in range(start, max(len(table), len(held))):
            block = table[column] if column < len(table) else PAD_BLOCK
            if column >= len(held) or held[column] != block:
                diffs += (row, column, block)
        held[:] = table  # in place: `held` lists it too
