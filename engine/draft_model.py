"""Draft-model speculation: a smaller model of the same tokenizer proposes the drafted samples' tokens,
over a paged KV of its own that the target's block tables index.

The draft's KV tensor has the target's blocks (the same ids and block size, its own layers and heads),
so a sequence's blocks hold its K and V in both models: allocation, copy on write, preemption and zero
on free (`engine.block_ops`, run on both tensors) need nothing new, and the draft's state is exactly as
request-scoped as the target's. Every step runs the draft over the step's own tokens (prompt chunks
too, so its cache follows the target's), then one-token forwards for the drafted samples, each fed
the previous pick; a sample drafting n tokens takes part in n of them (the last writes its last
draft's K and V, needed if every draft is accepted). The picks stay on the device: they fill the
placeholders of the target's verifying forward and of the verification's drafts (`engine.speculative`).
All of it rides in the step's one upload; nothing of it is read back.

The draft picks as the target would, under the sample's logit bias as the target's verification adds
it: argmax for greedy samples, and for drawing ones the sampler's
draw (`engine.sampling_draw`, of the engine's kind: a draft-model engine races by default, the coupling
that makes drafts agree) over the draft's filtered distribution, with the target's randomness at the
same (seed, output position). A draft is then accepted where both models' draws agree, every emitted
token is the target's own draw (`verify_deterministic`), and the target as its own draft is always
accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.bridge import Bridge, Upload
from engine.config import ModelConfig
from engine.errors import EngineError
from engine.loader import load_model
from engine.models.layers import AttentionMetadata
from engine.overlap import fill_placeholders, placeholder
from engine.sampler import Filters, filter_batch
from engine.sampling_draw import RACE, draw
from engine.sampling_params import MIN_TEMPERATURE, SamplingParams
from engine.speculative import SPEC_INTS

DRAFT_LONGS, DRAFT_INTS, DRAFT_FLOATS = "draft.longs", "draft.ints", "draft.floats"
DRAFT_BIAS = "draft.bias"


def draft_folder(speculative: str | None) -> Path | None:
    """The draft model's folder that `EngineConfig.speculative` names ("draft:DIR"), else None."""
    if speculative is None or not speculative.startswith("draft:"):
        return None
    return Path(speculative.removeprefix("draft:"))


@dataclass(slots=True)
class DraftedSample:
    """A sample the draft proposes for this step."""

    chunk: int  # its chunk's index in the step: its row of the step's block tables
    start: int  # the position of its last token, whose K and V the step computes
    count: int  # drafts to propose
    params: SamplingParams
    seed: int | None
    position: int  # the output position of the first token the step emits for it
    block_table: list[int]


@dataclass(slots=True)
class DraftRequest:
    """What the draft runs in a step: the step's own tokens (its chunks without drafts), then the drafts."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    context_lens: list[int]
    cu_seqlens_q: list[int]
    max_seqlen_q: int
    drafted: list[DraftedSample]
    block_size: int


@dataclass(slots=True)
class DraftPlan:
    """The draft's part of the step's upload, as the host packed it."""

    tokens: int  # the step's own tokens
    seqs: int
    max_seqlen_q: int
    rows: int  # drafted samples
    width: int  # columns of the picks tensor: one more than the most drafts of a sample
    forwards: list[int]  # samples in each one-token forward
    sorts: bool
    draws: bool
    draw_kind: str  # the engine's (`engine.sampling_draw`)
    biases: int = 0  # logit bias entries of the drafted samples


def assign_placeholders(drafts: list[list[int]]) -> int:
    """Rewrites each drafted chunk's drafts, in place, as placeholders for the draft's picks; returns the width.

    Sample i's j-th draft is entry i * width + j of the picks tensor (`DraftModel.propose`).
    """
    width = 1 + max(map(len, drafts), default=0)
    for row, draft in enumerate(drafts):
        draft[:] = [placeholder(row * width + j) for j in range(len(draft))]
    return width


class DraftModel:
    def __init__(self, folder: Path, dtype: torch.dtype, device: torch.device, bridge: Bridge,
                 target: ModelConfig, target_folder: Path, max_model_len: int, draw_kind: str = RACE) -> None:
        _check_pair(folder, target, target_folder, max_model_len)
        self.draw_kind = draw_kind  # the target's: its drafts agree with the target's draws only then
        self.model = load_model(folder, dtype, device, bridge)
        self.config = self.model.config
        self.dtype = dtype
        self.device = device
        self.kv_cache = torch.zeros(0, dtype=dtype, device=device)

    def block_bytes(self, block_size: int) -> int:
        mc = self.config
        per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
        return per_token * block_size * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The draft's KV tensor over the target's blocks: zeros, like the target's."""
        mc = self.config
        shape = (2 * mc.num_hidden_layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def pack(self, upload: Upload, request: DraftRequest) -> DraftPlan:
        """Adds the step's draft work to `upload`: one int64, one int32 and one float32 segment."""
        drafted, size = request.drafted, request.block_size
        width = 1 + max((d.count for d in drafted), default=0)
        draws = [not d.params.greedy for d in drafted]
        top_ks = [d.params.top_k if 0 < d.params.top_k < self.config.vocab_size else self.config.vocab_size
                  for d in drafted]
        longs = (request.input_ids + request.positions + request.slot_mapping
                 + [request.cu_seqlens_q[d.chunk + 1] - 1 for d in drafted]  # each drafted sample's last token
                 + [row * width for row in range(len(drafted))]
                 + top_ks + [d.seed or 0 for d in drafted] + [d.position for d in drafted])
        ints = request.context_lens + request.cu_seqlens_q
        # The target verifies biased rows (`engine.speculative`): drafting under the same bias keeps the
        # draft's picks those the target would make, so the target as its own draft is still accepted.
        biases = [(row, token, bias) for row, d in enumerate(drafted) for token, bias in d.params.logit_bias]
        forwards = []
        for j in range(1, width):
            active = [(row, d) for row, d in enumerate(drafted) if d.count >= j]
            forwards.append(len(active))
            positions = [d.start + j for _, d in active]
            slots = [d.block_table[p // size] * size + p % size for (_, d), p in zip(active, positions)]
            longs += ([row * width + j - 1 for row, _ in active] + positions + slots
                      + [d.chunk for _, d in active] + [row * width + j for row, _ in active])
            ints += [p + 1 for p in positions] + list(range(len(active) + 1))
        longs += [row for row, _, _ in biases] + [token for _, token, _ in biases]
        upload.add(DRAFT_LONGS, longs, torch.int64)
        upload.add(DRAFT_INTS, ints, torch.int32)
        # A temperature of 0 marks a greedy sample.
        upload.add(DRAFT_FLOATS, [d.params.temperature if draw else 0.0 for d, draw in zip(drafted, draws)]
                   + [d.params.top_p for d in drafted] + [d.params.min_p for d in drafted], torch.float32)
        if biases:
            upload.add(DRAFT_BIAS, [bias for _, _, bias in biases], torch.float32)
        sorts = any(k < self.config.vocab_size for k in top_ks) or any(d.params.top_p < 1.0 for d in drafted)
        return DraftPlan(len(request.input_ids), len(request.context_lens), request.max_seqlen_q, len(drafted),
                         width, forwards, sorts, any(draws), self.draw_kind, len(biases))

    def propose(self, plan: DraftPlan, views: dict[str, torch.Tensor], tables: torch.Tensor) -> torch.Tensor | None:
        """Runs the draft's forwards and returns its picks [rows * width] (int64, on the device); None if
        no sample drafts this step (the draft's cache still takes the step's tokens).

        Also fills the verification's draft placeholders, when the step verifies, with the picks.
        """
        picks = torch.zeros(plan.rows * plan.width, dtype=torch.int64, device=self.device)
        longs, ints = _Reader(views[DRAFT_LONGS]), _Reader(views[DRAFT_INTS])
        tokens, seqs = plan.tokens, plan.seqs
        input_ids, positions, slots = longs.take(tokens), longs.take(tokens), longs.take(tokens)
        first_rows, first_out = longs.take(plan.rows), longs.take(plan.rows)
        temperatures, top_p, min_p = views[DRAFT_FLOATS].split([plan.rows] * 3)
        settings = _PickSettings(longs.take(plan.rows), longs.take(plan.rows), longs.take(plan.rows),
                                 temperatures, top_p, min_p)
        if plan.biases:  # the bias entries end the segment, after every forward's part
            bias_rows, bias_tokens = views[DRAFT_LONGS][-2 * plan.biases:].split([plan.biases] * 2)
            settings.bias = (bias_rows, bias_tokens, views[DRAFT_BIAS])
        meta = AttentionMetadata(slots, tables, ints.take(seqs), ints.take(seqs + 1), plan.max_seqlen_q)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if plan.rows:
            logits = self.model.compute_logits(hidden.index_select(0, first_rows))
            picks.index_copy_(0, first_out, settings.pick(logits, first_out, plan))
        for count in plan.forwards:
            ids, positions, slots, rows, out = (longs.take(count) for _ in range(5))
            meta = AttentionMetadata(slots, tables.index_select(0, rows), ints.take(count), ints.take(count + 1), 1)
            hidden = self.model(picks.index_select(0, ids), positions, self.kv_cache, meta)
            picks.index_copy_(0, out, settings.pick(self.model.compute_logits(hidden), out, plan))
        if not plan.rows:
            return None
        if SPEC_INTS in views:
            fill_placeholders(views[SPEC_INTS], picks)
        return picks


@dataclass(slots=True)
class _PickSettings:
    """Each drafted sample's settings on the device, indexed by its row."""

    top_k: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    temperatures: torch.Tensor  # 0: greedy
    top_p: torch.Tensor
    min_p: torch.Tensor
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (sample row, token, value) entries

    def pick(self, logits: torch.Tensor, out: torch.Tensor, plan: DraftPlan) -> torch.Tensor:
        """The draft's pick for each row of `logits`, whose entries of the picks tensor are `out`."""
        logits = logits.float()
        # Each row's drafted sample: needed by a bias or a draw, not by a greedy unbiased step.
        rows = torch.div(out, plan.width, rounding_mode="floor") if plan.draws or self.bias is not None else None
        if self.bias is not None:
            logits = _biased(logits, rows, plan.rows, *self.bias)
        best = torch.nan_to_num(logits, nan=-torch.inf).argmax(dim=-1)
        if not plan.draws:
            return best
        column = out - rows * plan.width  # the draft's index: its output position is the sample's plus it
        temperatures = self.temperatures.index_select(0, rows)
        scaled = logits / temperatures.clamp_min(MIN_TEMPERATURE).unsqueeze(-1)
        filters = Filters(self.top_k.index_select(0, rows), self.top_p.index_select(0, rows),
                          self.min_p.index_select(0, rows), plan.sorts)
        probs = filter_batch(torch.softmax(scaled, dim=-1), filters)
        is_distribution, drawn = draw(plan.draw_kind, probs, self.seeds.index_select(0, rows),
                                      self.positions.index_select(0, rows) + column)
        return torch.where((temperatures > 0) & is_distribution, drawn, best)


def _biased(logits: torch.Tensor, rows: torch.Tensor, samples: int, bias_rows: torch.Tensor, tokens: torch.Tensor,
            values: torch.Tensor) -> torch.Tensor:
    """`logits` [n, vocab], row i of drafted sample rows[i], with each bias entry of its sample added, entry by
    entry as the sampler adds them. An entry of a sample with no row in this forward goes to a scratch row."""
    n = logits.shape[0]
    row_of = torch.full((samples,), n, dtype=torch.int64, device=logits.device)  # n: the scratch row
    row_of.index_copy_(0, rows, torch.arange(n, device=logits.device))
    padded = torch.cat([logits, logits.new_zeros(1, logits.shape[1])])
    return padded.index_put((row_of.index_select(0, bias_rows), tokens), values, accumulate=True)[:n]


class _Reader:
    """Consecutive slices of a flat segment, in the order `DraftModel.pack` wrote them."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values
        self.at = 0

    def take(self, count: int) -> torch.Tensor:
        self.at += count
        return self.values[self.at - count : self.at]


def _check_pair(folder: Path, target: ModelConfig, target_folder: Path, max_model_len: int) -> None:
    """A draft must share the target's tokenizer (its tokens are the target's, id for id) and reach as far."""
    draft = ModelConfig.from_folder(folder)
    if draft.max_context < max_model_len:
        raise EngineError(f"the draft model serves {draft.max_context} tokens of context, fewer than the engine's "
                          f"{max_model_len}; lower max_model_len or use another draft")
    if draft.vocab_size != target.vocab_size:
        raise EngineError(f"the draft model's vocabulary ({draft.vocab_size}) is not the target's ({target.vocab_size})")
    mine, theirs = folder / "tokenizer.json", target_folder / "tokenizer.json"
    if not mine.is_file() or not theirs.is_file() or mine.read_bytes() != theirs.read_bytes():
        raise EngineError("the draft model's tokenizer.json is not the target's: drafts must be the target's tokens")
