"""What the engine reports about itself besides deltas: blocks zeroed and residue found among them.

The residue check is a reduction over the blocks just zeroed, where they lie; its counts stay on the
device and add up there, so a step never waits for one. Whoever reports them reads the sum (one
device-to-host copy) at its own cadence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from engine.block_manager import BlockManager


@dataclass(frozen=True, slots=True)
class ZeroingReport:
    """Since the previous report: blocks zeroed, residue found among those still free, requests ended."""

    blocks: int
    residue: int
    requests_ended: int
    step: int  # the engine step the report follows

    def plus(self, later: ZeroingReport) -> ZeroingReport:
        return ZeroingReport(self.blocks + later.blocks, self.residue + later.residue,
                             self.requests_ended + later.requests_ended, later.step)


class ZeroingAccount:
    """Checks each step's zeroed blocks for residue and keeps the tally until it is taken."""

    def __init__(self, block_manager: BlockManager, kv_cache: torch.Tensor) -> None:
        self._block_manager = block_manager
        self._kv_cache = kv_cache
        block_manager.track_scrubbed()
        self._blocks = 0
        self._residue: torch.Tensor | int = 0
        self._requests_ended = 0

    @property
    def pending(self) -> bool:
        return bool(self._blocks or self._requests_ended)

    def check(self) -> None:
        """Residue-checks the blocks zeroed since the last call that are still free.

        Only blocks still free are checked: one zeroed early in a step may already hold a new request's data.
        """
        zeroed = self._block_manager.take_recently_scrubbed()
        if not zeroed:
            return
        still_free = [block for block in zeroed if self._block_manager.ref_count(block) == 0]
        self._blocks += len(zeroed)
        if still_free:
            self._residue = self._residue + kernels.count_residue(self._kv_cache, still_free)

    def request_ended(self, count: int = 1) -> None:
        self._requests_ended += count

    def take(self, step: int) -> ZeroingReport:
        self.check()
        report = ZeroingReport(self._blocks, int(self._residue), self._requests_ended, step)
        self._blocks, self._residue, self._requests_ended = 0, 0, 0
        return report
