"""Turns logits into tokens for a whole batch at once: greedy, temperature, top-k, top-p, min-p, seeded draws.

One step is a fixed handful of batched tensor ops, whatever mix of settings its rows carry. Each
sample's settings, seed and output position live on the device (`engine.sampling_tables`), written at
its first pick; a step's upload carries the row map, each pick's logits row and slot, in one segment
(`StepSettings.pack`, then `bind` once it has crossed; `engine.bridge`), and its picks, with any
requested logprobs packed beside them, leave in one segment of the step's one download. The download is started with the picks (`launch`) and waited for
only when the values are read (`_to_host`), so an engine that schedules asynchronously launches the
next step in between; the picked ids stay on the device for that step's inputs.
Draws are the engine's kind (`engine.sampling_draw`: inverse transform, or an exponential race) over
counter-based randomness (`engine.sampling_noise`), a pure function of the sample's seed and its output
position, so a seeded request picks the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.bridge import Bridge, Download, DownloadPlan, Upload
from engine.errors import EngineError
from engine.logits_processors import LogitsProcessors, ProcessingPlan, RowSettings
from engine.sampling_draw import DRAWS, INVERSE, descending_keys, draw, first_index
from engine.sampling_noise import NoiseBuffers
from engine.sampling_params import MIN_TEMPERATURE, SamplingParams
from engine.sampling_tables import (
    MIN_P, POSITION, SEED, TEMPERATURE, TOP_K, TOP_P, SamplingTables, StepValues, TablesPlan,
)
from engine.sequence import TokenLogprob


# The sampler's segments in a step's crossings (`engine.bridge`); the settings' diff is `engine.sampling_tables`'.
SETTINGS, PICKS = "sampler.settings", "sampler.picks"


@dataclass(slots=True)
class SampleRequest:
    """One token to pick: which logits row, under which settings, with which seed at which output position."""

    row: int
    params: SamplingParams
    seed: int | None  # needed unless params.greedy
    position: int = 0  # tokens the sample has output so far: selects its uniform
    slot: int | None = None  # its row of token counts when it is penalized (`engine.logits_processors`)
    mask_row: int | None = None  # its row of the step's grammar masks when its output is constrained
    sample: int | None = None  # the sample's key (its sequence id): its settings stay on the device under it


@dataclass(slots=True)
class Filters:
    """Per-row top-k, top-p and min-p as [rows] tensors; `sorts` is whether any row needs the sort."""

    top_k: torch.Tensor  # int64; the vocabulary size where a row sets none
    top_p: torch.Tensor  # float32; 1.0 = off
    min_p: torch.Tensor  # float32; 0.0 = off
    sorts: bool


@dataclass(slots=True)
class DrawSettings:
    """The drawn rows' settings as device views, cut from the step's table rows once: [drawn] each."""

    temperatures: torch.Tensor  # [drawn, 1] float32: at least MIN_TEMPERATURE (lower ones are greedy rows)
    seeds: torch.Tensor  # int64
    positions: torch.Tensor  # int64: each row's output position, which selects its uniform
    filters: Filters | None  # None when no drawn row sets top-k, top-p or min-p


@dataclass(slots=True)
class SettingsPlan:
    """One step's settings as the host packed them into the upload: what the device views are cut into."""

    order: list[int]  # request index of each reordered row
    drawn: int
    slotted: int  # rows whose settings come from the device tables: the drawn ones, then greedy biased or penalized
    wanted: list[int]  # reordered rows that report logprobs
    logprob_counts: list[int]  # alternatives each of those asked for
    sorts: bool
    filtered: bool  # a drawn row sets top-k, top-p or min-p
    tables: TablesPlan
    in_place: bool  # row k of the picks is row k of the logits: no gather needed when they have as many
    ordered: bool  # `order` is the request order: each request's row is its own index
    processed: bool  # a row is biased, penalized or constrained: the logits processors have work


@dataclass(slots=True)
class SamplerPlan:
    """What `Sampler.pack` put in a step's upload: the settings, and the logits processors' part (None: none)."""

    settings: SettingsPlan
    processing: ProcessingPlan | None


@dataclass(slots=True)
class StepSettings:
    """One step's settings as device tensors: the upload's row map and the tables' rows it selects.

    Rows are reordered so those that draw come first (`drawn` of them), then greedy rows with
    bias or penalties, then plain greedy rows: the draw works on a slice, greedy rows cost one argmax, and
    only the first `slotted` rows read the device tables (`engine.sampling_tables`).
    """

    order: list[int]  # request index of each reordered row
    drawn: int
    rows: torch.Tensor  # [rows] the logits row of each
    slots: torch.Tensor  # [slotted] each slotted row's slot of the tables
    transient: torch.Tensor  # slots taken for this step alone
    values: StepValues  # [slotted] rows of the tables
    draws: DrawSettings | None  # None when no row draws
    logprob_rows: torch.Tensor  # [wanted] reordered rows that report logprobs
    wanted: list[int]  # the same rows, on the host
    logprob_counts: list[int]  # alternatives each of those asked for
    filtered: bool  # a drawn row sets top-k, top-p or min-p: `filters` must run
    tables: TablesPlan
    ordered: bool  # rows are in request order

    @staticmethod
    def pack(upload: Upload, requests: list[SampleRequest], vocab_size: int, tables: SamplingTables
             ) -> SettingsPlan:
        """Adds the step's row map (and the tables' diff) to `upload`: one int32 segment, whatever the mix."""
        drawing: list[int] = []
        penalized: list[int] = []
        plain: list[int] = []
        sorts = filtered = reports = processed = False
        # One pass, every row's settings read once: it runs for every row of every step.
        for i, request in enumerate(requests):
            params = request.params
            if params.logprobs is not None:
                reports = True
            if params.logit_bias or request.slot is not None or request.mask_row is not None:
                processed = True
            if params.temperature >= MIN_TEMPERATURE:  # `not params.greedy`, spelled out
                if request.seed is None:
                    _with_seed(request)
                drawing.append(i)
                sorts = sorts or 0 < params.top_k < vocab_size or params.top_p < 1.0
                filtered = filtered or params.min_p > 0.0
            # A penalized sample holds a slot of token counts from its first pick: without one nothing could
            # penalize it, so it is plain (and `params.penalized`, a property, stays off the plain rows' path).
            elif request.slot is not None or params.logit_bias:  # read from the tables
                penalized.append(i)
            else:
                plain.append(i)
        slotted = len(drawing) + len(penalized)
        # Rows of one kind keep the request order, and then nothing needs looking up through the order.
        ordered = len(drawing) == len(requests) or len(plain) == len(requests)
        order = list(range(len(requests))) if ordered else drawing + penalized + plain
        chosen = requests if ordered else [requests[i] for i in order]
        slots, tables_plan = tables.pack(upload, chosen[:slotted], vocab_size)
        wanted = [k for k, request in enumerate(chosen) if request.params.logprobs is not None] if reports else []
        rows = [request.row for request in chosen]
        # int32: row and slot numbers fit, and every index op takes them (half the bytes of int64).
        upload.add(SETTINGS, rows + slots + wanted + tables_plan.transient, torch.int32)
        counts = [chosen[k].params.logprobs for k in wanted]
        in_place = rows == order if ordered else rows == list(range(len(rows)))  # each pick reads its own row, in order
        return SettingsPlan(order, len(drawing), slotted, wanted, counts, sorts, sorts or filtered, tables_plan,
                            in_place, ordered, processed)

    @classmethod
    def bind(cls, plan: SettingsPlan, views: dict[str, torch.Tensor], tables: SamplingTables) -> StepSettings:
        """The settings `pack` added, as the device views the upload's send returned and the tables' rows."""
        # `split_with_sizes`: `split` with a list goes through a Python wrapper first (twice the time).
        rows, slots, logprob_rows, transient = views[SETTINGS].split_with_sizes(
            [len(plan.order), plan.slotted, len(plan.wanted), len(plan.tables.transient)])
        values = tables.gather(plan.tables, views, slots)
        draws = None
        if plan.drawn:
            ints, floats = values.ints, values.floats
            if plan.drawn < plan.slotted:  # else every row of them draws: no cut (a tensor op fewer each)
                ints, floats = ints[: plan.drawn], floats[: plan.drawn]
            filters = None  # cut only when a row filters: three tensor ops fewer in most sampled steps
            if plan.filtered:
                filters = Filters(ints[:, TOP_K], floats[:, TOP_P], floats[:, MIN_P], plan.sorts)
            draws = DrawSettings(floats[:, TEMPERATURE : TEMPERATURE + 1], ints[:, SEED], ints[:, POSITION], filters)
        return cls(plan.order, plan.drawn, rows, slots, transient, values, draws, logprob_rows, plan.wanted,
                   plan.logprob_counts, plan.filtered, plan.tables, plan.ordered)


@dataclass(slots=True)
class PickedTokens:
    """One step's picks once launched: the ids on the device now, their values on the host after `results`.

    `tokens` is in the sampler's row order (drawn rows first); `row_of[i]` is request i's row there.
    """

    tokens: torch.Tensor  # [requests] int64, on the logits' device
    row_of: list[int]
    step: StepSettings
    copy: Download | None = None  # the step's download, which carries the picks in segment PICKS

    def results(self) -> list[tuple[int, TokenLogprob | None]]:
        """The token (and logprob, if asked) of each request, in request order; waits for the copy."""
        results = _unpack(_to_host(self.copy), self.step)
        return results if self.step.ordered else [results[row] for row in self.row_of]


class Sampler:
    def __init__(self, processors: LogitsProcessors | None = None, bridge: Bridge | None = None,
                 draw_kind: str = INVERSE) -> None:
        if draw_kind not in DRAWS:
            raise EngineError(f"a sampler draws by one of {', '.join(DRAWS)}")
        self.processors = processors  # bias, penalties and grammar masks (`engine.logits_processors`)
        self._bridge = bridge  # the engine's; a sampler used alone makes its own for the logits' device
        self._owns_bridge = False  # whether `_bridge` is that own one, which `scrub` zeroes
        self.draw_kind = draw_kind  # `engine.sampling_draw`'s kind: the engine's, for its verification too
        self._noise = NoiseBuffers()  # the race's noise block, reused from step to step (empty until it races)
        self._tables: SamplingTables | None = None  # each sample's settings on the device, made at the first pack

    def release(self, sample: int) -> None:
        """Zeroes an ended sample's settings on the device and frees their slot (`engine.sampling_tables`)."""
        if self._tables is not None:
            self._tables.release(sample)

    @property
    def tables(self) -> SamplingTables:
        if self._tables is None:
            if self._bridge is None:
                raise EngineError("a sampler packs only once it has a bridge (the engine's, or launch's own)")
            self._tables = SamplingTables(self._bridge.device)
        return self._tables

    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[tuple[int, TokenLogprob | None]]:
        """The token (and logprob, if asked) of each request, in request order; nothing of them stays in the
        sampler's own bridge, if it made one (`scrub`)."""
        if not requests:
            return []
        try:
            return self.launch(logits, requests).results()
        finally:
            self.scrub()

    def scrub(self) -> None:
        """Zeroes what the latest picks left in the sampler's own bridge (`Bridge.scrub`), once they are read
        or dropped: `__call__` does so before it returns; a tool that calls `launch` alone calls this once it
        has read the results. The engine's bridge is the engine's to scrub: this leaves it alone."""
        if self._owns_bridge:
            self._bridge.scrub()

    def launch(self, logits: torch.Tensor, requests: list[SampleRequest], masks: torch.Tensor | None = None,
               download: DownloadPlan | None = None) -> PickedTokens:
        """Sends the settings, queues the picks and starts their download: one crossing each way.

        `masks`: the step's grammar masks, host bitmasks (`engine.structured`), when a request is constrained.
        `download`: segments others added already, to cross with the picks.
        """
        if self._bridge is None:
            self._bridge, self._owns_bridge = Bridge(logits.device), True
        upload = self._bridge.upload()
        plan = self.pack(upload, requests, logits.shape[-1], masks)
        download = DownloadPlan() if download is None else download
        picked = self.pick(logits, plan, self._bridge.send(upload), download)
        picked.copy = self._bridge.fetch(download)
        return picked

    def pack(self, upload: Upload, requests: list[SampleRequest], vocab_size: int,
             masks: torch.Tensor | None = None) -> SamplerPlan:
        """Adds everything the picks need to the step's upload: settings, and what the logits processors use."""
        settings = StepSettings.pack(upload, requests, vocab_size, self.tables)
        processing = None
        # New penalty slots' prompts are marked at the slot's first step, which has a penalized row too.
        if self.processors is not None and (settings.processed or self.processors.slots.unmarked):
            rows = [RowSettings(requests[i].params, requests[i].slot, requests[i].mask_row) for i in settings.order]
            processing = self.processors.pack(upload, rows, masks)
        return SamplerPlan(settings, processing)

    def pick(self, logits: torch.Tensor, plan: SamplerPlan, views: dict[str, torch.Tensor],
             download: DownloadPlan) -> PickedTokens:
        """Queues the picks of a non-empty batch and adds them (and logprobs) to the step's download.

        Logprobs are the model's own, before bias, penalties and grammar masks (vLLM's default).
        """
        step = StepSettings.bind(plan.settings, views, self.tables)
        # Nothing writes into `raw` (each processor and the draw make new tensors), so it may be the logits.
        in_place = plan.settings.in_place and logits.shape[0] == len(step.order)
        raw = picked = logits if in_place else logits.index_select(0, step.rows)
        if raw.dtype != torch.float32:  # checked here: `float()` of a float32 tensor is still a call through torch
            raw = picked = raw.float()
        counting = None
        if self.processors is not None:
            picked, counting = self.processors.apply(raw, plan.processing, views, step.values)
        keys = descending_keys(picked.shape[-1], picked.device)
        tokens = _most_likely(picked, keys)
        if step.drawn:
            # Every row draws in most sampled steps: then no row is cut off (two tensor ops fewer).
            every = step.drawn == tokens.shape[0]
            fallback, drawing = (tokens, picked) if every else (tokens[: step.drawn], picked[: step.drawn])
            torch.where(*_draw(drawing, step, self.draw_kind, self._noise), fallback, out=fallback)
        if self.processors is not None:
            self.processors.record(counting, tokens)
        self.tables.advance(step.tables, step.slots, step.transient)
        # The inverse of the order (request i is at row row_of[i]); the request order is its own inverse.
        order = step.order
        row_of = order if plan.settings.ordered else sorted(range(len(order)), key=order.__getitem__)
        download.add(PICKS, _pack(raw, tokens, step))
        return PickedTokens(tokens, row_of, step)


def _draw(logits: torch.Tensor, step: StepSettings, kind: str, noise: NoiseBuffers
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each drawn row's token from its filtered softmax (`engine.sampling_draw`). Returns (is a distribution, draw).

    A row whose probabilities are no distribution (NaN, or nothing left) takes its `_most_likely` pick instead.
    """
    # Rows under the floor are greedy and never get here. Were a temperature 0 regardless, its row's
    # division would make it no distribution: it would take its greedy pick.
    draws = step.draws
    probs = torch.softmax(logits.div(draws.temperatures), dim=-1)
    if step.filtered:  # each filter is a few passes over the block: none runs when no row filters
        probs = filter_batch(probs, draws.filters)
    return draw(kind, probs, draws.seeds, draws.positions, noise)


def _most_likely(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[rows] the greedy pick, NaN logits ranked last: what a distribution collapsed onto one token means.

    A drawn row falls back to it where scaled logits overflow, when one token holds all the mass;
    failing the request instead would cut off a stream its caller has partly received, for no better answer.
    """
    ranked = torch.nan_to_num(logits, nan=-torch.inf)  # a new tensor, which the marks then overwrite
    return first_index(torch.ge(ranked, ranked.amax(dim=-1, keepdim=True), out=ranked), keys)


def filter_batch(probs: torch.Tensor, filters: Filters) -> torch.Tensor:
    """[rows, vocab] probabilities with what each row's top-k, min-p and top-p exclude zeroed.

    The most likely token always stays; surviving probabilities are unchanged (not renormalised).
    """
    # Filtering multiplies by the kept mask: the same values as a torch.where against 0 (probabilities
    # are finite or NaN, and a NaN row is no distribution either way), at a fraction of its cost on a CPU.
    best = probs.amax(dim=-1, keepdim=True)
    if not filters.sorts:
        return probs * (probs >= filters.min_p.unsqueeze(-1) * best)
    # Stable, so tied tokens rank by id on every device.
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    kth = sorted_probs.gather(-1, (filters.top_k - 1).unsqueeze(-1))
    # Both keep every probability at or above a threshold, so what stays is a prefix of the sorted row.
    threshold = torch.maximum(kth, filters.min_p.unsqueeze(-1) * best)
    probs = probs * (probs >= threshold)
    sorted_probs = sorted_probs * (sorted_probs >= threshold)
    # top-p keeps a token while the mass ranked before it is under top_p of what survived.
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    top_p = filters.top_p.unsqueeze(-1)
    keep_sorted = (before < top_p * sorted_probs.sum(dim=-1, keepdim=True)) | (top_p >= 1.0)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return probs * keep


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's probabilities under `params`' filters (see `filter_batch`)."""
    vocab_size = probs.shape[-1]
    top_k = _top_k(params.top_k, vocab_size)
    # Scalars filled on the device (no host tensor crosses): this helper serves tests and tools.
    filters = Filters(
        probs.new_full((1,), top_k, dtype=torch.int64),
        probs.new_full((1,), params.top_p, dtype=torch.float32),
        probs.new_full((1,), params.min_p, dtype=torch.float32),
        sorts=top_k < vocab_size or params.top_p < 1.0,
    )
    return filter_batch(probs.unsqueeze(0), filters)[0]


def _pack(logits: torch.Tensor, tokens: torch.Tensor, step: StepSettings) -> torch.Tensor:
    """The picked ids, then the logprobs asked for, in one tensor so that one copy brings all to the host."""
    if not step.logprob_counts:
        return tokens
    log_probs = torch.log_softmax(logits.index_select(0, step.logprob_rows), dim=-1)
    chosen = log_probs.gather(-1, tokens.index_select(0, step.logprob_rows).unsqueeze(-1))
    parts = [tokens.double(), chosen.double().flatten()]
    widest = max(step.logprob_counts)
    if widest:
        top = torch.topk(log_probs, widest, dim=-1)
        parts += [top.indices.double().flatten(), top.values.double().flatten()]
    # float64 holds every token id and every float32 logprob exactly.
    return torch.cat(parts)


def _unpack(values: list, step: StepSettings) -> list[tuple[int, TokenLogprob | None]]:
    """Splits `_pack`'s values back into (token, logprob or None) per reordered row."""
    if not step.wanted:  # the ids alone, as int64: host ints already
        return list(zip(values, [None] * len(values)))
    tokens = [int(v) for v in values[: len(step.order)]]
    logprobs: list[TokenLogprob | None] = [None] * len(tokens)
    wanted = step.wanted
    widest = max(step.logprob_counts, default=0)
    chosen_at, top_at = len(tokens), len(tokens) + len(wanted)
    top_values_at = top_at + len(wanted) * widest
    for n, (row, count) in enumerate(zip(wanted, step.logprob_counts)):
        start = n * widest
        ids = values[top_at + start : top_at + start + count]
        top_values = values[top_values_at + start : top_values_at + start + count]
        alternatives = tuple((int(i), v) for i, v in zip(ids, top_values))
        logprobs[row] = TokenLogprob(tokens[row], values[chosen_at + n], alternatives)
    return list(zip(tokens, logprobs))


def _with_seed(request: SampleRequest) -> None:
    if request.seed is None:
        raise EngineError("a sample that draws needs a seed; the engine gives every sequence one at admission")


def _top_k(top_k: int, vocab_size: int) -> int:
    """A row's top-k as a count to keep: the whole vocabulary when off (0) or not smaller than it."""
    return top_k if 0 < top_k < vocab_size else vocab_size


def _to_host(copy: Download) -> list:
    """The step's picks as host values: the one place a step waits for the device (for its download)."""
    return copy.values()[PICKS]
