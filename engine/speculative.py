"""Speculative steps: which samples draft, and the picks of a step whose drafted rows verify k+1 positions.

A sample that decodes proposes up to k draft tokens (`engine.ngram_draft`); the scheduler gives them
KV slots after its last token, and the step's one forward computes the target's logits at all 1 + k
positions over the paged cache (a prefill-shaped query of the sequence). The picks then verify each
drafted row by rejection sampling (`engine.spec_rejection`) beside the plain rows the sampler picks,
all in the step's one upload and one download (`engine.bridge`): the settings and drafts go up as two
segments of their own, the emitted tokens and their counts come back as one.

Drafts live in the step's chunks and plan only: nothing of them outlives the step, and the slots of
rejected drafts lie past the sample's computed tokens, where the next step overwrites them or, once
whole blocks, the engine frees (and zeroes) them (`BlockManager.trim`).

Logprobs of the emitted tokens are the target's own at each position, as the sampler reports them.
A sample's logit bias is added to each of its rows before they verify, as the sampler adds it before
it picks: the bias is the same at every position, so the verified distribution is the one plain
decoding picks from. Samples whose picks depend on the tokens before them in ways a row cannot see
(penalties count the sample's own tokens, drafts included; a grammar's mask follows its matcher) are
not drafted for: they pick one token a step as before, in the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.bridge import Download, DownloadPlan, Upload
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.ngram_draft import NgramDrafter
from engine.sampler import Filters, PickedTokens, SampleRequest, Sampler, SamplerPlan, filter_batch
from engine.sampling_params import MIN_TEMPERATURE, SamplingParams
from engine.sequence import Sequence, TokenLogprob
from engine.spec_rejection import verify_deterministic, verify_greedy

# The verification's segments in a step's crossings.
SPEC_INTS, SPEC_FLOATS, SPEC_PICKS = "speculative.ints", "speculative.floats", "speculative.picks"
SPEC_LOGPROBS = "speculative.logprobs"
SPEC_BIAS = "speculative.bias"


class Drafting:
    """Proposes a sample's drafts for one step: n-gram lookup over its own tokens, within its limits."""

    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        k = config.num_speculative_tokens
        # A draft model drafts for every sample it may: the scheduler reserves the slots, the draft fills them.
        self.drafter = NgramDrafter(k) if config.speculative == "ngram" else _Slots(k)
        self.max_model_len = max_model_len

    def __call__(self, seq: Sequence, budget: int) -> list[int]:
        """Up to k drafts to follow seq's last token this step; [] where it may not or need not draft.

        `budget`: step tokens left beside the sample's own. Drafts never run past max_tokens or the
        context, so every emitted token is one plain decoding could have emitted.
        """
        if not drafts_for(seq.params) or seq.pending_row is not None or seq.forks_pending:
            return []
        room = min(budget, seq.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        if room < 1:
            return []
        return self.drafter.propose(seq.prompt_token_ids + seq.output_token_ids, room)


@dataclass(frozen=True, slots=True)
class _Slots:
    """k slots for a draft model's tokens: placeholders until the step runs (`engine.draft_model`)."""

    num_speculative_tokens: int

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        return [0] * min(limit, self.num_speculative_tokens)


def drafts_for(params: SamplingParams) -> bool:
    """Whether a sample's picks depend on the target's distribution (biased or not) alone, which verification
    reproduces at every position."""
    return not params.penalized and params.structured is None


@dataclass(slots=True)
class VerifyRequest:
    """A drafted sample: its rows of the step's logits start at `row`, one per draft and one more."""

    row: int
    draft: list[int]
    params: SamplingParams
    seed: int | None  # needed unless params.greedy
    position: int  # its output tokens so far: the output position of the first token this step emits


@dataclass(slots=True)
class SpeculativeBatch:
    """A step's picks: plain rows (the sampler's, one token each) and drafted rows to verify."""

    plain: list[SampleRequest]
    verify: list[VerifyRequest]


@dataclass(slots=True)
class VerifyPlan:
    """The verification as packed: drawing rows first, each padded to `width` = 1 + the longest draft."""

    order: list[int]  # verify index of each reordered row
    drawn: int
    width: int
    sorts: bool
    lengths: list[int]  # drafts of each request, in request order
    wanted: list[int]  # reordered rows that report logprobs
    logprob_counts: list[int]  # alternatives each of those asked for
    biases: int = 0  # logit bias entries of all rows


@dataclass(slots=True)
class SpeculativePlan:
    plain: SamplerPlan | None
    verify: VerifyPlan


@dataclass(slots=True)
class SpeculativePicks:
    """A speculative step's picks once launched; `copy` is the step's download, set by whoever fetched it."""

    plain: PickedTokens | None
    verify: VerifyPlan
    copy: Download | None = None

    def results(self) -> list[list[tuple[int, TokenLogprob | None]]]:
        """Every sample's tokens this step, the plain ones (one each) first, then the drafted ones."""
        plain: list[list[tuple[int, TokenLogprob | None]]] = []
        if self.plain is not None:
            self.plain.copy = self.copy
            plain = [[result] for result in self.plain.results()]
        values = self.copy.values()
        return plain + _unpack(values[SPEC_PICKS], values.get(SPEC_LOGPROBS, []), self.verify)


@dataclass(slots=True)
class SpeculationStats:
    """Counts over the engine's life (numbers only: no token of any request)."""

    steps: int = 0  # speculative steps
    rows: int = 0  # drafted samples verified, summed over the steps
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    emitted: int = 0  # tokens the drafted samples emitted: the accepted ones and one more each

    def add(self, picks: SpeculativePicks, results: list[list[tuple[int, TokenLogprob | None]]]) -> None:
        drafted = results[len(results) - len(picks.verify.lengths) :]
        self.steps += 1
        self.rows += len(drafted)
        self.drafted += sum(picks.verify.lengths)
        self.accepted += sum(len(tokens) - 1 for tokens in drafted)
        self.emitted += sum(map(len, drafted))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class SpeculativeSampler:
    """Packs and picks a speculative step as `Sampler` does a plain one (`ModelRunner.run` calls both alike)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def pack(self, upload: Upload, batch: SpeculativeBatch, vocab_size: int,
             masks: torch.Tensor | None = None) -> SpeculativePlan:
        plain = self.sampler.pack(upload, batch.plain, vocab_size, masks) if batch.plain else None
        return SpeculativePlan(plain, _pack(upload, batch.verify, vocab_size))

    def pick(self, logits: torch.Tensor, plan: SpeculativePlan, views: dict[str, torch.Tensor],
             download: DownloadPlan) -> SpeculativePicks:
        plain = None if plan.plain is None else self.sampler.pick(logits, plan.plain, views, download)
        picks, logprobs = _verify(logits, plan.verify, views, self.sampler.draw_kind)
        download.add(SPEC_PICKS, picks)
        if logprobs is not None:
            download.add(SPEC_LOGPROBS, logprobs)
        return SpeculativePicks(plain, plan.verify)


def _pack(upload: Upload, requests: list[VerifyRequest], vocab_size: int) -> VerifyPlan:
    drawing = [i for i, r in enumerate(requests) if not r.params.greedy]
    order = drawing + [i for i, r in enumerate(requests) if r.params.greedy]
    width = 1 + max(len(r.draft) for r in requests)
    rows: list[int] = []
    drafts: list[int] = []
    for i in order:
        request = requests[i]
        last = request.row + len(request.draft)
        # Padding repeats the last row: the verification never reads past a row's own length.
        rows += [min(request.row + j, last) for j in range(width)]
        drafts += request.draft + [0] * (width - 1 - len(request.draft))
    draws = [requests[i] for i in drawing]
    if any(r.seed is None for r in draws):
        raise EngineError("a sample that draws needs a seed; the engine gives every sequence one at admission")
    top_ks = [r.params.top_k if 0 < r.params.top_k < vocab_size else vocab_size for r in draws]
    wanted = [j for j, i in enumerate(order) if requests[i].params.logprobs is not None]
    # (reordered row, token, bias) of every entry, in each sample's own order, as the sampler adds them.
    biases = [(j, token, bias) for j, i in enumerate(order) for token, bias in requests[i].params.logit_bias]
    upload.add(SPEC_INTS, rows + drafts + [len(requests[i].draft) for i in order] + top_ks
               + [r.seed for r in draws] + [r.position for r in draws] + wanted
               + [j for j, _, _ in biases] + [token for _, token, _ in biases], torch.int64)
    if draws:
        upload.add(SPEC_FLOATS, [r.params.temperature for r in draws] + [r.params.top_p for r in draws]
                   + [r.params.min_p for r in draws], torch.float32)
    if biases:
        upload.add(SPEC_BIAS, [bias for _, _, bias in biases], torch.float32)
    sorts = any(k < vocab_size for k in top_ks) or any(r.params.top_p < 1.0 for r in draws)
    counts = [requests[order[j]].params.logprobs for j in wanted]
    return VerifyPlan(order, len(draws), width, sorts, [len(r.draft) for r in requests], wanted, counts,
                      len(biases))


def _verify(logits: torch.Tensor, plan: VerifyPlan, views: dict[str, torch.Tensor], kind: str
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[rows * width + rows] int64: each reordered row's tokens (padded to width), then how many it emits;
    and the logprobs asked for (`_logprobs`), or None."""
    count, width, drawn = len(plan.order), plan.width, plan.drawn
    rows, drafts, lengths, top_k, seeds, positions, logprob_rows, bias_rows, bias_tokens = views[SPEC_INTS].split(
        [count * width, count * (width - 1), count] + [drawn] * 3 + [len(plan.wanted)] + [plan.biases] * 2)
    raw = table = logits.index_select(0, rows).float().view(count, width, -1)
    if plan.biases:  # every position of a row gets its sample's bias: a new tensor, so `raw` stays the model's
        table = _biased(raw, bias_rows, bias_tokens, views[SPEC_BIAS])
    drafts = drafts.view(count, width - 1)
    tokens, emitted = verify_greedy(table, drafts, lengths)
    if drawn:
        temperatures, top_p, min_p = views[SPEC_FLOATS].split([drawn] * 3)
        filters = Filters(top_k.repeat_interleave(width), top_p.repeat_interleave(width),
                          min_p.repeat_interleave(width), plan.sorts)
        # The sampler's own steps: scale, softmax, filter; then each position draws as the sampler would.
        scaled = table[:drawn] / temperatures.clamp_min(MIN_TEMPERATURE).view(drawn, 1, 1)
        probs = filter_batch(torch.softmax(scaled, dim=-1).flatten(0, 1), filters).view(drawn, width, -1)
        # n-gram drafts are deterministic; a position with no distribution falls back to its argmax.
        tokens[:drawn], emitted[:drawn] = verify_deterministic(probs, drafts[:drawn], lengths[:drawn], seeds,
                                                               positions, fallback=tokens[:drawn], kind=kind)
    logprobs = _logprobs(raw, tokens, logprob_rows, plan) if plan.wanted else None
    return torch.cat([tokens.flatten(), emitted]), logprobs


def _biased(table: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[rows, width, vocab] with each entry's bias added at every position of its row, entry by entry in
    the sample's order (repeated entries of a token add up as the sampler's do)."""
    width = table.shape[1]
    positions = torch.arange(width, device=table.device).repeat(rows.shape[0])
    index = (rows.repeat_interleave(width), positions, tokens.repeat_interleave(width))
    return table.index_put(index, values.repeat_interleave(width), accumulate=True)


def _logprobs(table: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, plan: VerifyPlan) -> torch.Tensor:
    """float64, per wanted row and position: the token's logprob, then the top alternatives' ids and values.

    The model's own, before any processor, as the sampler reports them; positions past what a row emits
    are computed and never read.
    """
    log_probs = torch.log_softmax(table.index_select(0, rows), dim=-1)
    chosen = log_probs.gather(-1, tokens.index_select(0, rows).unsqueeze(-1))
    parts = [chosen.double().flatten()]
    widest = max(plan.logprob_counts)
    if widest:
        top = torch.topk(log_probs, widest, dim=-1)
        parts += [top.indices.double().flatten(), top.values.double().flatten()]
    # float64 holds every token id and every float32 logprob exactly.
    return torch.cat(parts)


def _unpack(values: list, logprobs: list, plan: VerifyPlan) -> list[list[tuple[int, TokenLogprob | None]]]:
    """The emitted tokens (and logprobs, if asked) of each drafted sample, in request order."""
    count, width = len(plan.order), plan.width
    emitted = values[count * width :]
    results: list[list[tuple[int, TokenLogprob | None]]] = [[] for _ in range(count)]
    for row, index in enumerate(plan.order):
        start = row * width
        results[index] = [(int(token), None) for token in values[start : start + int(emitted[row])]]
    widest = max(plan.logprob_counts, default=0)
    cells = len(plan.wanted) * width  # (row, position) pairs, each with one chosen logprob
    for n, (row, alternatives) in enumerate(zip(plan.wanted, plan.logprob_counts)):
        picks = results[plan.order[row]]
        for position, (token, _) in enumerate(picks):
            cell = n * width + position
            top_ids = logprobs[cells + cell * widest : cells + cell * widest + alternatives]
            top_values = logprobs[cells * (1 + widest) + cell * widest :][:alternatives]
            top = tuple((int(i), v) for i, v in zip(top_ids, top_values))
            picks[position] = (token, TokenLogprob(token, logprobs[cell], top))
    return results
