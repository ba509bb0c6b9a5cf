"""Per-sample sampling settings that live on the device, updated by the diff each step's upload carries.

A sample's settings (temperature, top-k, top-p, min-p, penalties, logit bias), its seed and its output
position are the same from step to step, but for the position, which grows by one a pick. So each
sample holds a slot, a row of the device tables, from its first pick to its end; the host keeps a mirror of what each
slot holds and uploads only the slots that differ (a new sample, or one whose position moved other
than by its picks, as a speculative step moves it), plus the slot of each of the step's rows. Each
pick adds one to its slot's position on the device, and the mirror does the same.

Nothing of a sample outlives it: `release` (the engine calls it when the sample ends) zeroes the slot's
rows on the device, queued after every pick already queued, before the slot serves another sample. A
pick whose request names no sample (tests, tools) takes a slot for its step alone, zeroed after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.bridge import Upload
from engine.sampling_params import SamplingParams

# The tables' segments in a step's upload: the written slots' int and float columns, and their bias entries.
DIFF_INTS, DIFF_FLOATS = "sampling.diff_ints", "sampling.diff_floats"
BIAS_INTS, BIAS_FLOATS = "sampling.bias_ints", "sampling.bias_floats"
# Columns of the int64 table, then of the float32 one.
TOP_K, SEED, POSITION = range(3)
TEMPERATURE, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE = range(6)
_INTS, _FLOATS = 3, 6
_INITIAL_SLOTS = 8
_KEPT_STEP_SHAPES = 16


class SlottedRow(Protocol):
    """What the tables read of a pick (`engine.sampler.SampleRequest`)."""

    sample: int | None  # the sample's key; None: a slot for this step alone
    params: SamplingParams
    seed: int | None
    position: int


@dataclass(slots=True)
class _Held:
    """What a slot holds on the device, as the host last wrote or advanced it."""

    params: SamplingParams
    seed: int
    position: int  # the position column once every queued pick has added its one


@dataclass(slots=True)
class TablesPlan:
    """What `SamplingTables.pack` put in a step's upload, and the one-step slots to zero after the picks."""

    rows: int  # rows packed, each with its slot
    written: int  # slots rewritten whole
    transient: list[int]
    bias_entries: int  # (slot, column, token) entries of the written slots' logit bias


@dataclass(slots=True)
class StepValues:
    """The step's rows' settings, gathered from the tables on the device: [rows, columns] each.

    The logit bias is gathered only when read (few steps have a biased row): from the tables as they
    stand, which nothing writes between a step's gather and its picks.
    """

    ints: torch.Tensor
    floats: torch.Tensor
    slots: torch.Tensor  # [rows] each row's slot
    tables: SamplingTables

    @property
    def bias_tokens(self) -> torch.Tensor:
        """[rows, bias width] int64: each row's biased token ids, 0 past its entries."""
        return self.tables.bias_tokens.index_select(0, self.slots)

    @property
    def bias_values(self) -> torch.Tensor:
        """[rows, bias width] float32: their biases, 0.0 past the entries (adds nothing)."""
        return self.tables.bias_values.index_select(0, self.slots)


class SamplingTables:
    """The device tables and their host mirror; one per sampler."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ints = torch.zeros((0, _INTS), dtype=torch.int64, device=device)
        self.positions = self.ints[:, POSITION]  # a view of the column, made again when the table grows
        self.floats = torch.zeros((0, _FLOATS), dtype=torch.float32, device=device)
        # Logit bias: as wide as the most entries any sample has had (at most MAX_LOGIT_BIAS_ENTRIES).
        self.bias_tokens = torch.zeros((0, 0), dtype=torch.int64, device=device)
        self.bias_values = torch.zeros((0, 0), dtype=torch.float32, device=device)
        # A step of plain greedy rows reads no row of the tables: its values, made once.
        self._no_ints, self._no_floats = self.ints, self.floats
        self._steps: dict[int, torch.Tensor] = {}  # `_position_steps`' by row count
        self._held: list[_Held | None] = []
        self._free: list[int] = []
        self.slot_of: dict[int, int] = {}  # sample key -> slot, for every sample that picked and has not ended
        self._unpicked: tuple[list[int], list[int]] | None = None  # the latest pack's slots until its picks advance

    @property
    def held(self) -> int:
        return len(self._held) - len(self._free)

    def pack(self, upload: Upload, rows: Sequence[SlottedRow], vocab_size: int) -> tuple[list[int], TablesPlan]:
        """Each row's slot, after adding the slots whose device rows differ from the row's settings to `upload`."""
        if self._unpicked is not None:
            self._forget(*self._unpicked)
        if len(self._free) < len(rows):  # at most every row new: one growth at most, whatever the count
            self._grow(len(self._held) + len(rows) - len(self._free))
        slots: list[int] = []
        transient: list[int] = []
        ints: list[int] = []
        floats: list[float] = []
        bias: list[tuple[int, int, int, float]] = []  # (slot, column, token, value)
        slot_of, held_by_slot = self.slot_of, self._held  # read for every row of every step
        for row in rows:
            key, p, position = row.sample, row.params, row.position
            slot = slot_of.get(key)  # None for a key of None too: no sample is keyed so
            if slot is None:
                slot = self._free.pop()
                if key is None:
                    transient.append(slot)
                else:
                    slot_of[key] = slot
            seed = row.seed or 0  # greedy rows draw nothing
            held = held_by_slot[slot]
            if held is None or held.params is not p or held.seed != seed or held.position != position:
                # top-k as a count to keep: the whole vocabulary when off (0) or not smaller than it.
                top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
                ints += (slot, top_k, seed, position)
                floats += (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
                           p.presence_penalty)
                if held is None or held.params is not p:  # a new sample: its bias too (a freed slot holds none)
                    _bias_entries(slot, p, None if held is None else held.params, bias)
                held = self._held[slot] = _Held(p, seed, position)
            held.position = position + 1  # the pick adds its one on the device
            slots.append(slot)
        written = len(ints) // 4
        if written:
            upload.add(DIFF_INTS, ints, torch.int64, (written, 4))
            upload.add(DIFF_FLOATS, floats, torch.float32, (written, _FLOATS))
        if bias:
            self._widen(1 + max(column for _, column, _, _ in bias))
            upload.add(BIAS_INTS, [v for entry in bias for v in entry[:3]], torch.int64, (len(bias), 3))
            upload.add(BIAS_FLOATS, [entry[3] for entry in bias], torch.float32)
        self._unpicked = (slots, transient)
        return slots, TablesPlan(len(slots), written, transient, len(bias))

    def _forget(self, slots: list[int], transient: list[int]) -> None:
        """The previous pack's picks never ran (its step failed): its slots' device rows may not hold what
        the mirror says, so they are written again when next picked; its one-step slots are zeroed and freed."""
        for slot in slots:
            self._held[slot] = None
        for slot in transient:
            self._zero(slot)
        self._unpicked = None

    def gather(self, plan: TablesPlan, views: dict[str, torch.Tensor], slots: torch.Tensor) -> StepValues:
        """Writes the step's diff into the tables and returns its rows' settings (new tensors)."""
        if not plan.rows:  # plain greedy rows only: nothing is written or read
            return StepValues(self._no_ints, self._no_floats, slots, self)
        if plan.written:
            written = views[DIFF_INTS]
            self.ints.index_copy_(0, written[:, 0], written[:, 1:])
            self.floats.index_copy_(0, written[:, 0], views[DIFF_FLOATS])
        if plan.bias_entries:
            slot, column, token = views[BIAS_INTS].t()
            self.bias_tokens.index_put_((slot, column), token)
            self.bias_values.index_put_((slot, column), views[BIAS_FLOATS])
        return StepValues(self.ints.index_select(0, slots), self.floats.index_select(0, slots), slots, self)

    def advance(self, plan: TablesPlan, slots: torch.Tensor, transient: torch.Tensor) -> None:
        """After the step's picks: one more output position for each row's slot; one-step slots zeroed.

        `transient`: `plan.transient` on the device (a view of the step's upload).
        """
        self._unpicked = None
        if not plan.rows:
            return
        # Into the position column alone: index_add_ of whole [rows, columns] rows takes ten times as long.
        self.positions.index_add_(0, slots, self._position_steps(plan.rows))
        if plan.transient:
            transient = transient.long()  # index_fill_ takes int64 ids only
            self.ints.index_fill_(0, transient, 0)
            self.floats.index_fill_(0, transient, 0.0)
            self.bias_tokens.index_fill_(0, transient, 0)
            self.bias_values.index_fill_(0, transient, 0.0)
            for slot in plan.transient:
                self._held[slot] = None
            self._free += plan.transient

    def _position_steps(self, rows: int) -> torch.Tensor:
        """[rows] int64 ones: what one pick adds to its slot's position.

        Kept by row count (constants, no request data): a steady step adds it in one op, not three."""
        steps = self._steps.get(rows)
        if steps is None:
            if len(self._steps) >= _KEPT_STEP_SHAPES:  # batch sizes that vary would pile up
                self._steps.clear()
            steps = self._steps[rows] = _position_step_rows(rows, self.device)
        return steps

    def release(self, key: int) -> None:
        """Zeroes an ended sample's slot on the device (after every pick queued) and frees it; no-op if none."""
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self._zero(slot)

    def _zero(self, slot: int) -> None:
        self.ints[slot].zero_()
        self.floats[slot].zero_()
        self.bias_tokens[slot].zero_()
        self.bias_values[slot].zero_()
        self._held[slot] = None
        self._free.append(slot)

    # Normal tensors even when a step under inference mode grows them: `release` zeroes them in place
    # outside it, which an inference tensor refuses.
    @torch.inference_mode(False)
    def _grow(self, slots: int) -> None:
        """To at least `slots` slots. Doubling keeps reallocations logarithmic in the most samples held at once."""
        old = len(self._held)
        new = max(_INITIAL_SLOTS, 2 * old)
        while new < slots:
            new *= 2
        self.ints = torch.cat([self.ints, self.ints.new_zeros((new - old, _INTS))])
        self.positions = self.ints[:, POSITION]
        self.floats = torch.cat([self.floats, self.floats.new_zeros((new - old, _FLOATS))])
        width = self.bias_tokens.shape[1]
        self.bias_tokens = torch.cat([self.bias_tokens, self.bias_tokens.new_zeros((new - old, width))])
        self.bias_values = torch.cat([self.bias_values, self.bias_values.new_zeros((new - old, width))])
        self._held += [None] * (new - old)
        self._free += range(new - 1, old - 1, -1)

    @torch.inference_mode(False)
    def _widen(self, width: int) -> None:
        """Bias columns for `width` entries; new columns hold nothing (token 0, bias 0.0)."""
        old = self.bias_tokens.shape[1]
        if width <= old:
            return
        rows = self.bias_tokens.shape[0]
        self.bias_tokens = torch.cat([self.bias_tokens, self.bias_tokens.new_zeros((rows, width - old))], dim=1)
        self.bias_values = torch.cat([self.bias_values, self.bias_values.new_zeros((rows, width - old))], dim=1)


# Kept from step to step: a normal tensor even when first made under inference mode, readable outside it.
# Only making it leaves the mode: entering a mode costs tens of microseconds inside a step.
@torch.inference_mode(False)
def _position_step_rows(rows: int, device: torch.device) -> torch.Tensor:
    return torch.ones(rows, dtype=torch.int64, device=device)


def _bias_entries(slot: int, params: SamplingParams, before: SamplingParams | None,
                  entries: list[tuple[int, int, int, float]]) -> None:
    """A slot's bias entries, and empty ones over what the slot's previous settings held beyond them."""
    for column, (token, value) in enumerate(params.logit_bias):
        entries.append((slot, column, token, value))
    for column in range(len(params.logit_bias), 0 if before is None else len(before.logit_bias)):
        entries.append((slot, column, 0, 0.0))
