"""What the block manager asks of the KV tensor between two crossings: zero, copy, check for residue.

Zeroing a freed block needs its id on the device, and so does checking blocks for residue: sent on
their own, each would be a crossing of the bridge (`engine.bridge`). Instead they queue here, in the
order the host asked for them, ride in the next upload (the next step's, or one of their own when the
engine goes idle or is asked a question), and run on the device in that same order, before the step's
forward. So every block is zeroed before anything can write it again, in every order of frees, copies
and allocations: a block freed and handed to another sequence in the same step is zeroed by the op
queued at the free, which runs before the copy-on-write or the forward that writes it next.
Copies need no ids on the device (a block index is a view), but queue too, to keep that order.

Residue counts add up in a device tensor (`residue_found`) that every step's download carries back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from engine.bridge import Upload
from kernels.errors import KernelInputError

BLOCK_IDS = "block_ops.ids"  # the upload segment holding every queued op's block ids


@dataclass(frozen=True, slots=True)
class BlockOp:
    kind: str  # "zero" | "residue": ids[start:end]; "copy": K and V of block start into block end
    start: int
    end: int


@dataclass(slots=True)
class PendingBlockOps:
    """Ops queued since the last upload, with their block ids on the host."""

    num_blocks: int
    ops: list[BlockOp] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    def zero(self, block_ids: list[int]) -> None:
        self._queue_ids("zero", block_ids)

    def check_residue(self, block_ids: list[int]) -> None:
        self._queue_ids("residue", block_ids)

    def copy(self, source: int, destination: int) -> None:
        self.check_ids([source, destination])
        self.ops.append(BlockOp("copy", source, destination))

    def __bool__(self) -> bool:
        return bool(self.ops)

    def pack(self, upload: Upload) -> list[BlockOp]:
        """Adds the queued ids to `upload` and hands over the ops (the queue starts empty again)."""
        ops, self.ops = self.ops, []
        if self.ids:
            upload.add(BLOCK_IDS, self.ids, torch.int64)
            self.ids = []
        return ops

    def _queue_ids(self, kind: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        # Checked here on the host, so the device never reads ids back to check them.
        self.check_ids(block_ids)
        start = len(self.ids)
        self.ids += block_ids
        self.ops.append(BlockOp(kind, start, len(self.ids)))

    def check_ids(self, block_ids: list[int]) -> None:
        if not all(isinstance(b, int) and 0 <= b < self.num_blocks for b in block_ids):
            raise KernelInputError(f"block ids must lie in [0, {self.num_blocks}); some do not: no block was touched")


def apply(ops: list[BlockOp], views: dict[str, torch.Tensor], kv_cache: torch.Tensor,
          residue_found: torch.Tensor) -> None:
    """Runs the ops on the device in their queued order; residue counts add into residue_found."""
    ids = views.get(BLOCK_IDS)
    for op in ops:
        if op.kind == "zero":
            kernels.zero_blocks(kv_cache, ids[op.start : op.end], ids_in_range=True)
        elif op.kind == "residue":
            residue_found.add_(kernels.count_residue(kv_cache, ids[op.start : op.end], ids_in_range=True))
        else:
            kv_cache[:, op.end].copy_(kv_cache[:, op.start])


def dirty_flags(kv_cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[len(ids)] int32 on the device: 1 where the listed block holds any non-zero byte."""
    return kernels.residue_flags(kv_cache, ids, ids_in_range=True).index_select(0, ids)
