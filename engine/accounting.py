"""What the engine reports about itself besides deltas: blocks zeroed and residue found among them.

The residue check is a reduction over the blocks just zeroed, where they lie. It is queued with the
step's other block ops (`engine.block_ops`) and rides in the next upload; its counts add up on the
device, and every step's download carries the sum back, so a step never crosses the bridge for them.
A report reads the latest sum that came back (`take`), or, when asked to be exact (a query, the last
report, an idle engine), runs what is queued and reads the sum at once: one crossing each way, at the
report's own cadence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


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

    def __init__(self, block_manager: BlockManager, runner: ModelRunner) -> None:
        self._block_manager = block_manager
        self._runner = runner
        block_manager.track_scrubbed()
        self._blocks = 0
        self._residue_reported = runner.residue_read
        self._requests_ended = 0

    @property
    def pending(self) -> bool:
        return bool(self._blocks or self._requests_ended)

    def check(self) -> None:
        """Queues a residue check of the blocks zeroed since the last call that are still free.

        Only blocks still free are checked: one zeroed early in a step may already hold a new request's data.
        The check runs on the device after their zeroing and before anything written next (`engine.block_ops`).
        """
        zeroed = self._block_manager.take_recently_scrubbed()
        if not zeroed:
            return
        still_free = [block for block in zeroed if self._block_manager.ref_count(block) == 0]
        self._blocks += len(zeroed)
        self._runner.check_residue(still_free)

    def request_ended(self, count: int = 1) -> None:
        self._requests_ended += count

    def take(self, step: int, exact: bool = True) -> ZeroingReport:
        """The tally since the last report. Not `exact`: residue as of the latest step read (a check queued
        since then is counted in a later report), with no crossing of its own."""
        self.check()
        found = self._runner.read_residue() if exact else self._runner.residue_read
        report = ZeroingReport(self._blocks, found - self._residue_reported, self._requests_ended, step)
        self._blocks, self._residue_reported, self._requests_ended = 0, found, 0
        return report
