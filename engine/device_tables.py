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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.bridge import Upload

DIFF, ROWS = "tables.diff", "tables.rows"
PAD_BLOCK = -1


@dataclass(slots=True)
class TablePlan:
    """What `DeviceBlockTables.pack` put in a step's upload."""

    width: int  # columns of the step's tables: its widest table
    diffs: int  # (row, column, block) triples
    unchanged: bool = False  # the previous step's rows, width and entries: its gathered tables serve again


@dataclass(slots=True)
class DeviceBlockTables:
    device: torch.device
    max_blocks_per_seq: int
    tables: torch.Tensor = field(init=False)  # [rows, max_blocks_per_seq] int32 on the device
    mirror: list[list[int]] = field(default_factory=list)  # what each device row holds (entries up to its length)
    row_of: dict[int, int] = field(default_factory=dict)  # seq id -> row, for the sequences of the latest step
    seq_ids: list[int] = field(default_factory=list)  # the latest step's sequences, in its order
    rows: list[int] = field(default_factory=list)  # and their rows
    width: int = 0  # the latest step's widest table
    gathered: torch.Tensor | None = None  # the latest step's tables, as `step_tables` gathered them

    def __post_init__(self) -> None:
        self.tables = torch.full((0, self.max_blocks_per_seq), PAD_BLOCK, dtype=torch.int32, device=self.device)

    def pack(self, upload: Upload, seq_ids: list[int], block_tables: list[list[int]]) -> TablePlan:
        """Adds the step's rows and the entries that differ from what the device holds to `upload`."""
        # A steady decode step runs the sequences of the previous one, in the same order: same rows.
        kept = seq_ids == self.seq_ids
        rows = self.rows if kept else self._assign(seq_ids)
        mirror = self.mirror
        # Which rows differ, compared in one comprehension: in a decode step few do (a new block every
        # `block_size` tokens, a copy on write), so the per-row work of `_diff` is for those only.
        changed = [index for index, (row, table) in enumerate(zip(rows, block_tables)) if mirror[row] != table]
        diffs: list[int] = []
        for index in changed:
            self._diff(rows[index], block_tables[index], diffs)
        upload.add(ROWS, rows, torch.int32)  # row numbers fit; index_select takes int32 ids
        upload.add(DIFF, diffs, torch.int64, (len(diffs) // 3, 3))
        plan = TablePlan(max(map(len, block_tables)), len(diffs) // 3)
        plan.unchanged = kept and not diffs and plan.width == self.width
        if not plan.unchanged:
            self.gathered, self.width = None, plan.width  # gathered again by `step_tables`
        return plan

    def step_tables(self, plan: TablePlan, views: dict[str, torch.Tensor]) -> torch.Tensor:
        """Writes the diff into the device rows and returns the step's tables [seqs, width]: a new tensor, or
        the previous step's when nothing changed (nobody writes into it)."""
        if plan.unchanged and self.gathered is not None:
            return self.gathered  # read only, by attention and the graphs' copy
        if plan.diffs:
            rows, columns, blocks = views[DIFF].t()
            self.tables.index_put_((rows, columns), blocks.to(torch.int32))
        self.gathered = self.tables.index_select(0, views[ROWS])[:, : plan.width]
        return self.gathered

    def _assign(self, seq_ids: list[int]) -> list[int]:
        """Keeps the rows of sequences that were in the previous step; gives the others the rows left free."""
        if len(seq_ids) > len(self.mirror):
            self._grow(len(seq_ids))
        previous = self.row_of
        rows = [previous.get(seq_id, -1) for seq_id in seq_ids]
        if -1 in rows:
            free = sorted(set(range(len(self.mirror))).difference(rows), reverse=True)  # lowest rows first
            rows = [free.pop() if row == -1 else row for row in rows]
        self.row_of = dict(zip(seq_ids, rows))
        self.seq_ids, self.rows = list(seq_ids), rows
        return rows

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
        self.mirror[row] = list(table)
