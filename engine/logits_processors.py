"""Logit bias, presence/frequency/repetition penalties and grammar masks, for a whole step at once.

Each kind is one batched device op over the rows that use it, whatever mix of settings a step
carries; rows that use none are untouched. The order is vLLM's: bias first, then the repetition
penalty, then frequency and presence, then the grammar mask (which only removes tokens, so it
commutes with everything before it).

What a step needs crosses in the step's one upload (`engine.bridge`): `pack` adds the rows that use
each part and the grammar bitmasks, `apply` reads their device views; the bias entries and penalty
values are read from the sampler's device tables (`engine.sampling_tables`), written when a sample
starts. Nothing comes back: the counts are updated on the device.

Penalties need each sample's output-token counts on the device. They live in `PenaltySlots`: one
row per penalized sample, taken at its first pick (its prompt's tokens marked from a segment of that
step's upload), counted on the device from its picked ids (never through the host, so async
scheduling needs nothing more), kept across preemption (the sample's output is kept too) and zeroed
when the sample ends, before the row serves any other sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.bridge import Upload
from engine.sampling_params import SamplingParams
from engine.sampling_tables import FREQUENCY, PRESENCE, REPETITION, StepValues

# This module's segments in a step's upload.
INTS, MASKS = "processors.ints", "processors.masks"
_INITIAL_SLOTS = 4


class PenaltySlots:
    """Per-sample token counts ([slots, vocab] int32) and prompt tokens ([slots, vocab] bool) on the device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self._free: list[int] = []
        self.unmarked: list[tuple[int, list[int]]] = []  # new slots and their prompts, for the next step's upload

    @property
    def held(self) -> int:
        return self.counts.shape[0] - len(self._free)

    def take(self, prompt_ids: list[int]) -> int:
        """A zeroed slot for a new sample; its prompt's tokens are marked when the next step is applied."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.unmarked.append((slot, prompt_ids))
        return slot

    def release(self, slot: int) -> None:
        """Zeroes the slot on the device (queued after any step still counting into it) and frees it."""
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        self.unmarked = [(s, ids) for s, ids in self.unmarked if s != slot]
        self._free.append(slot)

    def mark(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Marks prompt tokens of new slots ([pairs] each, on the device)."""
        self.in_prompt.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.bool))

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Counts each slot's picked token, on the device."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    # Normal tensors even when a step under inference mode grows the pool: `release` zeroes them in place
    # outside it, which an inference tensor refuses.
    @torch.inference_mode(False)
    def _grow(self) -> None:
        # Doubling keeps the number of reallocations logarithmic in the most samples ever penalized at once.
        old = self.counts.shape[0]
        new = max(_INITIAL_SLOTS, 2 * old)
        self.counts = torch.cat([self.counts, self.counts.new_zeros((new - old, self.vocab_size))])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros((new - old, self.vocab_size))])
        self._free += range(new - 1, old - 1, -1)


@dataclass(slots=True)
class RowSettings:
    """What one pick needs beyond its sampling filters."""

    params: SamplingParams
    slot: int | None  # its PenaltySlots row; None when it has no penalties
    mask_row: int | None  # its row of the step's grammar masks; None when unconstrained


@dataclass(slots=True)
class ProcessingPlan:
    """How many of each part `pack` put in the step's upload: what `apply` cuts the device views into."""

    marks: int  # (slot, prompt token) pairs of new slots
    biased: int  # rows
    penalized: int  # rows
    masked: int  # rows


@dataclass(slots=True)
class Counting:
    """A step's penalized rows, whose picks `LogitsProcessors.record` counts once they are made."""

    rows: torch.Tensor
    slots: torch.Tensor


@dataclass(slots=True)
class Penalties:
    """Per-row penalty values, [rows] float32 each."""

    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor


class LogitsProcessors:
    """Applies a step's bias, penalties and grammar masks to its picked rows; owns the penalty slots."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.slots = PenaltySlots(vocab_size, device)

    def pack(self, upload: Upload, rows: list[RowSettings], masks: torch.Tensor | None) -> ProcessingPlan | None:
        """Adds what the step needs to its upload; None when no row uses any processor.

        `rows[k]` describes picked-logits row k; `masks` [constrained rows, ceil(vocab / 32)] int32 host bitmasks.
        """
        marks = [(slot, token) for slot, ids in self.slots.unmarked for token in ids]
        self.slots.unmarked = []
        biased = [k for k, row in enumerate(rows) if row.params.logit_bias]
        penalized = [k for k, row in enumerate(rows) if row.slot is not None]
        masked = [k for k, row in enumerate(rows) if row.mask_row is not None]
        if not (marks or biased or penalized or masked):
            return None
        # The bias and penalty values live on the device with the rest of each sample's settings
        # (`apply`'s `settings`): only which rows use them crosses with the step.
        upload.add(INTS, [s for s, _ in marks] + [t for _, t in marks] + biased + penalized
                   + [rows[k].slot for k in penalized] + masked + [rows[k].mask_row for k in masked], torch.int64)
        if masked:
            upload.add(MASKS, masks, torch.int32, tuple(masks.shape))
        return ProcessingPlan(len(marks), len(biased), len(penalized), len(masked))

    def apply(self, logits: torch.Tensor, plan: ProcessingPlan | None, views: dict[str, torch.Tensor],
              settings: StepValues) -> tuple[torch.Tensor, Counting | None]:
        """`logits` [rows, vocab] processed (a new tensor when anything applies), and what to count after the pick.

        `settings`: the step's rows' settings from the device tables (`engine.sampling_tables`), of every
        biased or penalized row at least.
        """
        if plan is None:
            return logits, None
        mark_slots, mark_tokens, bias_rows, pen_rows, slots, mask_rows, mask_index = views[INTS].split_with_sizes(
            [plan.marks] * 2 + [plan.biased] + [plan.penalized] * 2 + [plan.masked] * 2
        )
        if plan.marks:
            self.slots.mark(mark_slots, mark_tokens)
        if plan.biased:
            # A row's entries past its own are token 0 with a bias of 0.0: adding them changes nothing.
            tokens = settings.bias_tokens.index_select(0, bias_rows)
            rows = bias_rows.unsqueeze(-1).expand_as(tokens)
            logits = logits.index_put((rows, tokens), settings.bias_values.index_select(0, bias_rows), accumulate=True)
        if plan.penalized:
            chosen = settings.floats.index_select(0, pen_rows)
            penalties = Penalties(chosen[:, REPETITION], chosen[:, FREQUENCY], chosen[:, PRESENCE])
            logits = logits.index_copy(0, pen_rows, self._penalize(logits.index_select(0, pen_rows), slots, penalties))
        if plan.masked:
            bits = views[MASKS].index_select(0, mask_index)
            logits = logits.index_copy(0, mask_rows, apply_bitmask(logits.index_select(0, mask_rows), bits))
        # The views are overwritten by the next step's upload: what outlives the step is copied.
        return logits, Counting(pen_rows.clone(), slots.clone()) if plan.penalized else None

    def record(self, counting: Counting | None, tokens: torch.Tensor) -> None:
        """Counts a step's picks into their samples' slots, on the device, right after the pick."""
        if counting is not None:
            self.slots.record(counting.slots, tokens.index_select(0, counting.rows))

    def _penalize(self, logits: torch.Tensor, slots: torch.Tensor, penalties: Penalties) -> torch.Tensor:
        counts = self.slots.counts.index_select(0, slots)
        return penalize(logits, counts, self.slots.in_prompt.index_select(0, slots), penalties)


def penalize(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """[rows, vocab] logits under each row's penalties, given its output counts and prompt tokens."""
    seen = in_prompt | (counts > 0)
    repetition = penalties.repetition.unsqueeze(-1)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - penalties.frequency.unsqueeze(-1) * counts
    return logits - penalties.presence.unsqueeze(-1) * (counts > 0)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] logits with every token whose bit is clear in its row's int32 bitmask set to -inf."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[-1]]
    return logits.masked_fill(bits == 0, -torch.inf)
