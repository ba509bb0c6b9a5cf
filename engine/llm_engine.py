"""The engine: admits requests, steps the scheduler and the model, streams deltas, keeps nothing after."""

from __future__ import annotations

import itertools
import secrets
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.bridge import BridgeStats, Download, DownloadPlan
from engine.config import EngineConfig
from engine.draft_model import DraftedSample, DraftRequest, assign_placeholders
from engine.errors import EngineError, RequestRejected, UnknownRequestError
from engine.logits_processors import LogitsProcessors
from engine.model_runner import ModelRunner, PickRequest, StepLists, step_lists
from engine.output_processor import OutputProcessor
from engine.outputs import RequestMetrics, RequestOutput, StreamDelta, TokenOutput
from engine.overlap import async_scheduling_enabled
from engine.pooling import EMBEDDINGS, EmbeddingOutput, PoolingParams, PoolingStep, PoolSpan, unpack
from engine.sampler import PickedTokens, SampleRequest, Sampler
from engine.sampling_params import SamplingParams, is_integer
from engine.scheduler import ScheduledChunk, Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.speculative import (
    Drafting,
    SpeculationStats,
    SpeculativeBatch,
    SpeculativePicks,
    SpeculativeSampler,
    VerifyRequest,
)
from engine.structured import GrammarCompiler, Guide, MaskRequest
from engine.tokenizer import Tokenizer

_MAX_REQUEST_ID_LENGTH = 128
# What an embedding request's sequence is given: its room is its prompt and one slot, and it picks nothing.
_PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0)


def duplicate_request_id() -> RequestRejected:
    """The refusal of a request whose id a running one holds (an engine core's compiling ones too)."""
    return RequestRejected("duplicate_request_id", "a request with this id is already running")


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    sequences: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None
    finished: set[int] = field(default_factory=set)
    emitted_final: set[int] = field(default_factory=set)  # samples whose last delta has gone out


@dataclass(eq=False, slots=True)
class Embedded:
    """The embedding requests a step finished: their vectors ride its download (segment EMBEDDINGS), and
    each becomes its request's output when that download is read."""

    requests: list[Request]
    sizes: list[int]  # each vector's length, in the segment's order
    download: Download | None = None  # the step's, set by whoever fetched it


@dataclass(eq=False, slots=True)
class LaunchedStep:
    """A step whose forward and picks are queued: which sample each pick is for, and the picks."""

    samples: list[Sequence]  # in pick order
    picked: PickedTokens | SpeculativePicks | None  # None: the step picks nothing, and finished embeddings
    embedded: Embedded | None = None


@dataclass(eq=False, slots=True)
class ForwardOnly:
    """A launched step whose picks wait for the in-flight step's tokens: a constrained sample's mask needs
    its previous token (`engine.structured`). Picked once the in-flight step is read; the embeddings its
    forward finished ride the picks' download."""

    sampling: list[Sequence]
    logits: torch.Tensor
    embedded: Embedded | None = None
    embeddings: torch.Tensor | None = None  # their vectors, on the device until the picks' download


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.runner = ModelRunner(str(model_dir), self.config)
        self.tokenizer = Tokenizer(model_dir)
        # The text stage (`engine.output_processor`): `step` runs it after each token step. An engine
        # core has none: its client runs it (`engine.core_client`).
        self.output = OutputProcessor(self.tokenizer) if self.config.detokenize else None
        self.model_config = self.runner.model_config
        self.max_model_len = min(self.config.max_model_len or 1 << 62, self.model_config.max_context)
        scrub = _skip_scrub if self.config.unsafe_skip_zeroing else self.runner.zero_blocks
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, scrub, self.runner.copy_block
        )
        drafting = Drafting(self.config, self.max_model_len) if self.config.speculative else None
        self.scheduler = Scheduler(self.config, self.block_manager, drafting)
        self.sampler = Sampler(LogitsProcessors(self.model_config.vocab_size, self.runner.device), self.runner.bridge,
                               config.draw_kind)
        self.speculative_sampler = SpeculativeSampler(self.sampler)
        self.speculation = SpeculationStats()
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request: the vocabulary only
        self._grammars_lock = threading.Lock()
        # Speculative steps are read before the next is scheduled: how many drafts each sample accepted
        # sets the next step's positions, and its drafts come from the tokens it accepted.
        self.async_scheduling = async_scheduling_enabled(self.config, self.runner.device) and drafting is None
        self._in_flight: LaunchedStep | None = None  # async: launched, its picks not read yet
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        # An abort's or a finish's last outputs, out with the next step: as tokens where the text is made
        # elsewhere, else as deltas made at once (a request's id may be reused before that step).
        self._pending: list[TokenOutput] = []
        self._pending_deltas: list[StreamDelta] = []
        self.num_tokens_computed = 0  # every token run through the model, prompts and outputs
        self._num_pooling = 0  # embedding requests running: only then are a step's chunks looked at for them
        self._embeddings: list[EmbeddingOutput] = []  # finished embeddings, until `take_embeddings`

    # ----- requests -------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        compiled: Guide | None = None,
    ) -> str:
        """Queues a request and returns its id; raises RequestRejected (only this request fails).

        `compiled`: the matcher `compile_constraint` made for these very params, off the step loop (an
        engine core compiles on a worker thread); without it a constraint is compiled here.
        """
        params = params or SamplingParams()
        request_id = self._new_request_id(request_id)
        params.validate(self.model_config.vocab_size)
        prompt_ids = self._prompt_ids(prompt)
        max_tokens = self._check_fits(prompt_ids, params)
        if compiled is not None and params.structured is None:
            raise EngineError("a compiled constraint was given for a request that has none")
        guide = self._compile(params) if compiled is None else compiled
        first = self._new_sequence(request_id, 0, prompt_ids, params, max_tokens)
        first.guide = guide
        first.forks_pending = params.n - 1
        self._requests[request_id] = Request(request_id, params, len(prompt_ids), [first], time.monotonic())
        self.scheduler.add(first)
        if self.output is not None:
            self.output.add(request_id, params, prompt_ids)
        return request_id

    def add_embedding(self, prompt: str | list[int], pooling: PoolingParams, request_id: str | None = None) -> str:
        """Queues an embedding request (`engine.pooling`): a prefill-only request whose pooled final states
        come back from `take_embeddings` once its prompt is computed. Raises RequestRejected."""
        request_id = self._new_request_id(request_id)
        pooling.validate(self.model_config.hidden_size)
        prompt_ids = self._prompt_ids(prompt)
        self._check_fits(prompt_ids, _PREFILL_ONLY)
        seq = self._new_sequence(request_id, 0, prompt_ids, _PREFILL_ONLY, 1)
        seq.pooling = pooling
        self._requests[request_id] = Request(request_id, _PREFILL_ONLY, len(prompt_ids), [seq], time.monotonic())
        self._num_pooling += 1
        self.scheduler.add(seq)
        return request_id

    def take_embeddings(self) -> list[EmbeddingOutput]:
        """The embeddings finished since the last call (read with their step: with async scheduling, in the
        step after the one that completed their prompt); the engine keeps nothing of them."""
        taken, self._embeddings = self._embeddings, []
        return taken

    def embed(self, prompts: Iterable[str | list[int]], pooling: PoolingParams) -> list[list[float]]:
        """Offline embedding: one vector per prompt, in their order."""
        ids = [self.add_embedding(prompt, pooling) for prompt in prompts]
        vectors: dict[str, list[float]] = {}
        while self.has_unfinished():
            self.step_tokens()
            vectors.update((output.request_id, output.embedding) for output in self.take_embeddings())
        return [vectors[request_id] for request_id in ids]

    def abort(self, request_id: str) -> None:
        """Stops a request now: its blocks are freed and zeroed before this returns.

        The zeroing crosses on its own (`ModelRunner.flush`) rather than in the next step's upload: an
        abort is rare, and what it held is gone before the caller hears it is.
        """
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequestError("no such request in this engine")
        request.sequences += self._unforked(request.sequences[0])
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                self._finish(seq, FinishReason.ABORT)
        self._scrub_now()
        self._queue(self._token_outputs(request.sequences))

    def finish_sample(self, request_id: str, index: int) -> None:
        """Stops one sample now, as a stop string in its text does (found by the text stage, which may
        run in another process): blocks freed and zeroed before this returns, as `abort` does; its
        siblings go on. Its last output comes with the next step. A sample already ended is left as it is.
        """
        seq = self._end_sample(request_id, index)
        if seq is not None:
            self._scrub_now()
            self._queue(self._token_outputs([seq]))

    def _queue(self, outputs: list[TokenOutput]) -> None:
        if self.output is None:
            self._pending += outputs
        else:  # outputs without tokens: no stop string can come of them
            self._pending_deltas += self.output.process(outputs)[0]

    def _end_sample(self, request_id: str, index: int) -> Sequence | None:
        """Ends the sample a stop string ended (freeing its blocks); None if it had ended already."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        seq = next((s for s in request.sequences if s.sample_index == index), None)
        if seq is None or seq.is_finished:
            return None
        self._finish_and_free(seq, FinishReason.STOP)
        return seq

    def _scrub_now(self) -> None:
        """Zeroes what was freed now: its zeroing crosses on its own (`ModelRunner.flush`)."""
        self.block_manager.scrub_freed()
        self.runner.flush()
        self._clear_if_idle()

    def _unforked(self, parent: Sequence) -> list[Sequence]:
        """Samples not forked yet (the prompt is still being prefilled), made without blocks so that an
        abort ends each of them with its own last delta, as it does once they are forked."""
        children = [
            self._new_sequence(parent.request_id, index, parent.prompt_token_ids, parent.params, parent.max_tokens)
            for index in range(1, parent.forks_pending + 1)
        ]
        parent.forks_pending = 0
        return children

    def bridge_stats(self) -> BridgeStats:
        """Host-device crossings and their bytes: the latest step's and the engine's total (`engine.bridge`)."""
        return self.runner.bridge.stats()

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._pending or self._pending_deltas) or self._in_flight is not None

    def _clear_if_idle(self) -> None:
        # With nothing left to run, no token of a finished request may stay in the decode graphs' buffers
        # or the bridge's. A step still in flight needs them no more: the clear is queued after it on the
        # same stream. Block ops still queued cross first: no step is coming to carry them. With none in
        # flight, a download not read was dropped by a step that raised: the bridge waits for it and zeroes it.
        if not self.scheduler.has_work():
            self.runner.flush()
            self.runner.clear_step_buffers(settled=self._in_flight is None)

    # ----- stepping -------------------------------------------------------------------------

    def step(self) -> list[StreamDelta]:
        """Runs one batch and returns what every touched sample produced, as text.

        The token step (`step_tokens`) and the text stage (`engine.output_processor`) composed: a stop
        string the text stage finds ends its sample in this same step. With async scheduling the batch
        is launched before the previous one's picks are read, and the deltas returned are that previous
        batch's (`engine.overlap`); `has_unfinished` stays true until the last launched batch has been
        read. If a step raises, the caller aborts every request (the engine core does): what was in
        flight is dropped.
        """
        if self.output is None:
            raise EngineError("this engine steps tokens only (detokenize=False): its client makes the text")
        deltas, self._pending_deltas = self._pending_deltas, []
        new, stops = self.output.process(self._step_tokens())
        deltas += new
        if stops:  # ended now, as the core ends them when its client asks (`finish_sample`)
            ended = [seq for seq in (self._end_sample(*stop) for stop in stops) if seq is not None]
            deltas += self.output.process(self._token_outputs(ended))[0]
        self._end_step()
        return deltas

    def step_tokens(self) -> list[TokenOutput]:
        """Runs one batch and returns each touched sample's new tokens and end (`engine.outputs.TokenOutput`),
        with no text: no detokenization, stop strings or holdback. What an engine core's loop runs; stop
        token ids, EOS, max_tokens and a grammar's completion end samples here, stop strings do not."""
        outputs = self._step_tokens()
        self._end_step()
        return outputs

    def _step_tokens(self) -> list[TokenOutput]:
        outputs, self._pending = self._pending, []
        self.runner.bridge.begin_step()
        launched = self._launch()
        previous, self._in_flight = self._in_flight, None  # dropped even if reading it fails
        if previous is not None:
            outputs += self._read(previous)
        if isinstance(launched, ForwardOnly):
            launched = self._pick(launched)
        if launched is not None:
            if self.async_scheduling:
                self._hold(launched)
            else:
                outputs += self._read(launched)
        return outputs

    def _end_step(self) -> None:
        # One batched zeroing call per step for everything freed in it.
        self.block_manager.scrub_freed()
        self._clear_if_idle()

    def _launch(self) -> LaunchedStep | ForwardOnly | None:
        """Schedules and queues one batch and its picks; None when nothing ran, or nothing samples and no
        embedding finished.

        A batch with a constrained sample whose previous token is still in flight queues its forward
        only: its picks are queued once that token is read (`ForwardOnly`).
        """
        chunks = self.scheduler.schedule() if self.scheduler.has_work() else []
        if not chunks:
            return None
        drafting = self._drafting(chunks)
        drafts = None if self.scheduler.drafter is None else {c.seq.seq_id: c.draft for c in chunks if c.draft}
        lists, in_flight_ids = step_lists(chunks, self.config.block_size), self._in_flight_ids(chunks)
        self.num_tokens_computed += len(lists.input_ids)  # every chunk's tokens and drafts
        pooling = self._pooling_step(chunks, lists.cu_seqlens_q) if self._num_pooling else None
        sampling, waiting_mask = [], False
        for chunk in chunks:  # one pass: the chunks count as computed, and those that reach their end sample
            seq = chunk.seq
            computed = seq.num_computed_tokens = seq.num_computed_tokens + chunk.num_tokens
            # `num_tokens` spelled out: this runs for every chunk of every step.
            if (computed == len(seq.prompt_token_ids) + len(seq.output_token_ids) + (seq.pending_row is not None)
                    and seq.pooling is None):  # an embedding's ends when its states are pooled (`PoolingStep`)
                sampling.append(seq)
                waiting_mask = waiting_mask or (seq.guide is not None and seq.pending_row is not None)
        if waiting_mask:
            run = self.runner.run(lists, in_flight_ids, pooling=pooling)
            return ForwardOnly(sampling, run.logits, self._finish_embeddings(pooling), run.embeddings)
        # The picks' settings are known before the forward, so they ride in the step's one upload.
        picks = self._pick_request(sampling, drafts)
        if pooling is not None:
            return self._launch_pooling(lists, in_flight_ids, picks, drafting, pooling)
        request = None if picks is None else picks[1]
        if drafting is None:
            run = self.runner.run(lists, in_flight_ids, request)
        else:
            run = self.runner.run(lists, in_flight_ids, request, drafting)
        return None if picks is None else LaunchedStep(picks[0], run.picked)

    def _pooling_step(self, chunks: list[ScheduledChunk], cu_seqlens: list[int]) -> PoolingStep | None:
        """The step's embedding chunks and their rows; None if it has none. Called before the chunks count
        as computed: a chunk from position 0 starts its state afresh (a preempted request is recomputed)."""
        pooled: list[Sequence] = []
        spans: list[PoolSpan] = []
        for index, chunk in enumerate(chunks):
            seq = chunk.seq
            if seq.pooling is not None:
                if seq.num_computed_tokens == 0:
                    seq.pooled = None
                pooled.append(seq)
                spans.append(PoolSpan(cu_seqlens[index], cu_seqlens[index + 1], seq.pooling.kind))
        return PoolingStep(pooled, spans) if spans else None

    def _launch_pooling(self, lists: StepLists, in_flight_ids: torch.Tensor | None,
                        picks: tuple[list[Sequence], PickRequest] | None, drafting: DraftRequest | None,
                        pooling: PoolingStep) -> LaunchedStep | None:
        """Runs a step with embedding chunks: the vectors it finishes ride its picks' download, or, when it
        picks nothing, a download of their own (the step's one)."""
        run = self.runner.run(lists, in_flight_ids, None if picks is None else picks[1], drafting, pooling)
        embedded = self._finish_embeddings(pooling)
        if picks is None:
            return self._embeddings_only(embedded, run.embeddings)
        if embedded is not None:
            embedded.download = run.picked.copy
        return LaunchedStep(picks[0], run.picked, embedded)

    def _finish_embeddings(self, pooling: PoolingStep | None) -> Embedded | None:
        """Ends the embedding requests whose prompt the step computed (`PoolingStep.reduce` made their
        vectors): their blocks are freed (zeroed with the step's others); each request stays, its id taken,
        until its vector is read. None if none finished."""
        if pooling is None or not pooling.finished:
            return None
        for seq in pooling.finished:
            self._finish_and_free(seq, FinishReason.STOP)
        return Embedded([self._requests[seq.request_id] for seq in pooling.finished], pooling.sizes)

    @torch.inference_mode()  # as the forward was: the bridge's buffers are inference tensors
    def _embeddings_only(self, embedded: Embedded | None, vectors: torch.Tensor | None) -> LaunchedStep | None:
        """A step that picks nothing: the embeddings it finished come back in its one download."""
        if embedded is None:
            return None
        embedded.download = self.runner.bridge.fetch(_embeddings_download(vectors))
        return LaunchedStep([], None, embedded)

    def _emit_embeddings(self, embedded: Embedded) -> None:
        """Each finished request's vector, read with its step, as its output; the request is forgotten."""
        now = time.monotonic()
        for request, vector in zip(embedded.requests, unpack(embedded.download.take(EMBEDDINGS), embedded.sizes)):
            if self._requests.get(request.request_id) is not request:  # aborted while its vector was on its way
                continue
            del self._requests[request.request_id]
            metrics = RequestMetrics(request.num_prompt_tokens, 0, request.arrival_time, None, now)
            self._embeddings.append(EmbeddingOutput(request.request_id, vector, metrics))

    def _drafting(self, chunks: list[ScheduledChunk]) -> DraftRequest | None:
        """What a draft model runs in this step (None without one): the step's own tokens and the drafts.

        Called before the chunks count as computed; the drafts become placeholders for the draft's picks.
        """
        if self.runner.draft is None:
            return None
        drafted = [(index, chunk) for index, chunk in enumerate(chunks) if chunk.draft]
        assign_placeholders([chunk.draft for _, chunk in drafted])
        own = step_lists([ScheduledChunk(chunk.seq, chunk.num_tokens) for chunk in chunks], self.config.block_size)
        samples = [
            DraftedSample(index, chunk.seq.num_computed_tokens + chunk.num_tokens - 1, len(chunk.draft),
                          chunk.seq.params, chunk.seq.seed, chunk.seq.num_output_tokens, chunk.seq.block_table)
            for index, chunk in drafted
        ]
        return DraftRequest(own.input_ids, own.positions, own.slot_mapping, own.context_lens, own.cu_seqlens_q,
                            own.max_seqlen_q, samples, self.config.block_size)

    def _in_flight_ids(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """The in-flight step's picked ids when a chunk's input is a pending token of it, else None."""
        for chunk in chunks:  # a plain loop: all() over a generator costs twice as much, every step
            if chunk.seq.pending_row is not None:
                break
        else:
            return None
        if self._in_flight is None:  # only after a step failed and its requests were not aborted
            raise EngineError("a sample waits for a token no step in flight will supply; abort its request")
        return self._in_flight.picked.tokens

    def _hold(self, launched: LaunchedStep) -> None:
        """Keeps the launched batch in flight: its samples' next tokens are pending until it is read."""
        finished = SequenceStatus.FINISHED  # `is_finished` spelled out, as in `_read`
        if launched.picked is not None:
            for seq, row in zip(launched.samples, launched.picked.row_of):
                if seq.status is not finished:
                    seq.pending_row = row
        self._in_flight = launched

    def _read(self, launched: LaunchedStep) -> list[TokenOutput]:
        """Reads a launched batch's picks (waiting for the device) and applies them to their samples; the
        embeddings it finished become outputs (`take_embeddings`)."""
        now = time.monotonic()
        if launched.embedded is not None:
            self._emit_embeddings(launched.embedded)
        if launched.picked is None:
            return []
        results = launched.picked.results()
        self.runner.note_read(launched.picked.copy)
        if isinstance(launched.picked, SpeculativePicks):
            self.speculation.add(launched.picked, results)
            return self._read_speculative(launched.samples, results, now)
        finished = SequenceStatus.FINISHED  # `is_finished` spelled out: read for every sample of every step
        for seq, (token, logprob) in zip(launched.samples, results):
            seq.pending_row = None
            # One that stopped while this batch was in flight: its pick is dropped.
            if seq.status is not finished:
                self._accept(seq, token, logprob, now)
        return self._token_outputs(launched.samples)

    def _read_speculative(self, samples: list[Sequence], results: list[list[tuple[int, object]]], now: float
                          ) -> list[TokenOutput]:
        """Applies a speculative step's tokens: each sample's accepted drafts and the token after them.

        The accepted drafts' KV was computed by the step, so they count as computed; the blocks that held
        only rejected drafts are freed (and zeroed at the step's end).
        """
        for seq, picks in zip(samples, results):
            for token, logprob in picks:
                if seq.is_finished:  # a stop token among them: what follows is dropped (after a stop
                    break  # string, the text stage drops it)
                self._accept(seq, token, logprob, now)
            if not seq.is_finished:
                seq.num_computed_tokens += len(picks) - 1
                self.block_manager.trim(seq)
        return self._token_outputs(samples)

    def stream(self) -> Iterator[StreamDelta]:
        """Steps until every queued request has finished, yielding deltas as they come."""
        while self.has_unfinished():
            yield from self.step()

    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Offline batch generation: outputs in the order of `prompts`."""
        prompts = list(prompts)
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt)]
        outputs = {rid: RequestOutput(rid, []) for rid in ids}
        for delta in self.stream():
            if delta.request_id in outputs:
                outputs[delta.request_id].add(delta)
        return [outputs[rid] for rid in ids]

    # ----- checks ---------------------------------------------------------------------------

    def residue_check(self) -> list[int]:
        """Free blocks holding any non-zero byte (must always be empty).

        A reduction over the blocks where they lie (`kernels.find_residue`): a full pool is checked without
        copying it, and only one flag per free block is read back.
        """
        return self.runner.find_residue(self.block_manager.free_block_ids())

    # ----- internals ------------------------------------------------------------------------

    def _new_request_id(self, request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not request_id or len(request_id) > _MAX_REQUEST_ID_LENGTH or not request_id.isprintable():
            raise RequestRejected("invalid_request_id", "request ids must be 1-128 printable characters")
        if request_id in self._requests:
            raise duplicate_request_id()
        return request_id

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestRejected("empty_prompt", "the prompt is empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise RequestRejected("invalid_prompt", "the prompt must be a string or a list of token ids")
        # Never coerced: 6.7 would run as 6 and True as 1, a different prompt from the one sent.
        if not all(is_integer(t) for t in prompt):
            raise RequestRejected("invalid_token", "token ids must be integers")
        return list(prompt)

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> int:
        prompt_len = len(prompt_ids)
        if prompt_len == 0:
            raise RequestRejected("empty_prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestRejected("invalid_token", "the prompt contains token ids outside the model's vocabulary")
        if prompt_len >= self.max_model_len:
            raise RequestRejected(
                "prompt_too_long",
                f"the prompt has {prompt_len} tokens; this model serves at most {self.max_model_len - 1} prompt tokens"
                + self._window_note(),
            )
        max_tokens = self._room(prompt_len) if params.max_tokens is None else params.max_tokens
        if prompt_len + max_tokens > self.max_model_len:
            raise RequestRejected(
                "max_tokens_too_large",
                f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds the context of {self.max_model_len} tokens"
                + self._window_note(),
            )
        if self.block_manager.blocks_for(prompt_len + max_tokens) > self.block_manager.num_blocks:
            raise RequestRejected(
                "exceeds_kv_pool",
                f"prompt + max_tokens needs more KV blocks than this node's pool of {self.block_manager.num_blocks}",
            )
        return max_tokens

    def _room(self, prompt_len: int) -> int:
        """A request without max_tokens may write the rest of the context, as far as the KV pool holds it
        (at least one token: a prompt that leaves none is refused by the checks after)."""
        pool_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        return max(1, min(self.max_model_len, pool_tokens) - prompt_len)

    def _window_note(self) -> str:
        """Says so when the model's sliding window is what limits the context."""
        window = self.model_config.sliding_window
        if window is None or self.max_model_len < window:
            return ""
        return f" (the model's sliding window of {window} tokens: windowed attention is not implemented, so no sequence may exceed it)"

    def _new_sequence(
        self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams, max_tokens: int
    ) -> Sequence:
        return Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            sample_index=index,
            prompt_token_ids=prompt_ids,
            params=params,
            seed=self._seed(params, index),
            max_tokens=max_tokens,
        )

    @staticmethod
    def _seed(params: SamplingParams, index: int) -> int | None:
        """The seed of sample `index`'s draws; greedy samples draw nothing and need none."""
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        # Distinct, reproducible draws for the samples of one seeded request.
        return (seed * 1_000_003 + index) % (1 << 63)

    @torch.inference_mode()  # as the forward was: the bridge's buffers are inference tensors
    def _pick(self, step: ForwardOnly) -> LaunchedStep | None:
        """Queues the picks of a step whose forward ran already (`ForwardOnly`): a crossing each way of their
        own, whose download brings the embeddings the forward finished too."""
        picks = self._pick_request(step.sampling)
        if picks is None:
            return self._embeddings_only(step.embedded, step.embeddings)
        samplers, request = picks
        picked = self.sampler.launch(step.logits, request.requests, request.masks,
                                     _embeddings_download(step.embeddings))
        if step.embedded is not None:
            step.embedded.download = picked.copy
        return LaunchedStep(samplers, picked, step.embedded)

    def _pick_request(self, sampling: list[Sequence], drafts: dict[int, list[int]] | None = None
                      ) -> tuple[list[Sequence], PickRequest] | None:
        """What every sample whose chunk ended its tokens picks, forking new samples first; None if none does.

        `drafts` (by seq id): a drafted sample has a logits row per draft and one more, which verify them
        (`engine.speculative`); the step's samples are then the plain ones first, the drafted ones after.
        """
        requests: list[SampleRequest] = []
        samplers: list[Sequence] = []
        masks: list[MaskRequest] = []
        verify: list[VerifyRequest] = []
        drafted: list[Sequence] = []
        row = 0
        for seq in sampling:
            draft = drafts.get(seq.seq_id) if drafts else None
            if draft:
                verify.append(VerifyRequest(row, draft, seq.params, seq.seed, seq.num_output_tokens))
                drafted.append(seq)
                row += 1 + len(draft)
                continue
            children = self._fork(seq) if seq.forks_pending else ()  # forked first, as before their parent picks
            requests.append(self._sample_request(row, seq, masks))
            samplers.append(seq)
            for child in children:
                requests.append(self._sample_request(row, child, masks))
                samplers.append(child)
            row += 1
        if not requests and not verify:
            return None
        mask_bits = self._grammars.masks(masks) if masks else None
        if verify:
            batch = SpeculativeBatch(requests, verify)
            return samplers + drafted, PickRequest(self.speculative_sampler, batch, mask_bits)
        return samplers, PickRequest(self.sampler, requests, mask_bits)

    def _sample_request(self, row: int, sample: Sequence, masks: list[MaskRequest]) -> SampleRequest:
        """What picking `sample`'s token needs; a constrained sample's mask request joins `masks`.

        A sample that ended while this step waited (`ForwardOnly`) gets a plain pick, dropped when read.
        """
        params = sample.params
        # `num_output_tokens` and `is_finished` spelled out: read for every sample of every step.
        position = len(sample.output_token_ids) + (sample.pending_row is not None)
        if sample.status is SequenceStatus.FINISHED:
            # Its settings were zeroed at its end: this pick's last a step (`engine.sampling_tables`).
            return SampleRequest(row, params, sample.seed, position)
        request = sample.pick
        if request is not None:  # an unconstrained sample's, made at its first pick: read once a step, at its pack
            request.row, request.position = row, position
            return request
        slot = sample.penalty_slot  # taken only for a penalized sample
        if slot is None and params.penalized:  # its first pick: nothing output yet, so the counts start at zero
            slot = sample.penalty_slot = self.sampler.processors.slots.take(sample.prompt_token_ids)
        mask_row = None
        if sample.guide is not None:
            mask_row = len(masks)
            masks.append(MaskRequest(sample.guide, params.stop_token_ids))
        # Its settings stay on the device under its id until it ends.
        request = SampleRequest(row, params, sample.seed, position, slot, mask_row, sample.seq_id)
        if mask_row is None:  # a constrained sample's mask row is the step's own
            sample.pick = request
        return request

    def compile_constraint(self, params: SamplingParams) -> Guide | None:
        """A fresh matcher for `params`' constraint, or None when it has none; any thread may call it.

        Checks `params` first, so a request refused for its settings is refused for the same reason as by
        `add_request`. Nothing of the engine's state changes but the shared vocabulary index, built once.
        """
        params.validate(self.model_config.vocab_size)
        return self._compile(params)

    def _compile(self, params: SamplingParams) -> Guide | None:
        """A fresh matcher for this request's constraint (never one from a cache); None when it has none."""
        if params.structured is None:
            return None
        with self._grammars_lock:  # built once, by whichever thread comes first
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer.to_json(), self.model_config.vocab_size, sorted(self.eos_token_ids)
                )
        return self._grammars.compile(params.structured)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Creates the other samples of a request once its prompt is computed: they share its blocks."""
        if parent.forks_pending == 0:
            return []
        request = self._requests[parent.request_id]
        children = []
        for index in range(1, parent.forks_pending + 1):
            child = self._new_sequence(
                parent.request_id, index, parent.prompt_token_ids, parent.params, parent.max_tokens
            )
            self.block_manager.fork(parent, child)
            child.guide = None if parent.guide is None else parent.guide.fork()
            child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.add_running(child, parent)
            request.sequences.append(child)
            children.append(child)
        parent.forks_pending = 0
        return children

    def _accept(self, seq: Sequence, token: int, logprob, now: float) -> None:
        """Applies one token and whatever end it brings (speculative steps: token by token): appended
        unless it ends the sample, then the sample ends if its grammar is whole or at its length.

        Runs for every sample of every step, so the end checks are here rather than in a call of their own."""
        outputs = seq.output_token_ids
        if not outputs:  # a sample with output tokens has had its request's first token time set
            request = self._requests[seq.request_id]
            if request.first_token_time is None:
                request.first_token_time = now
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return self._finish_and_free(seq, FinishReason.STOP)
        outputs.append(token)  # `Sequence.append_token` spelled out: once per sample per step
        if logprob is not None:
            seq.logprobs.append(logprob)
        guide = seq.guide
        if guide is not None:
            if not guide.advance(token):
                # Never while its mask applies; a sample whose output broke its grammar is not served on.
                return self._finish_and_free(seq, FinishReason.ABORT)
            if guide.complete:  # the grammar allows nothing more: the output is whole
                return self._finish_and_free(seq, FinishReason.STOP)
        # At its length (stop strings: the text stage's); `num_tokens` spelled out.
        count = len(outputs)
        if count >= seq.max_tokens or (len(seq.prompt_token_ids) + count + (seq.pending_row is not None)
                                       >= self.max_model_len):
            self._finish_and_free(seq, FinishReason.LENGTH)

    def _finish_and_free(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.pending_row = None  # a token still in flight is no part of a finished sample
        self._drop_pick_state(seq)
        if seq.pooling is not None:  # an embedding's running state goes with it, however it ends
            seq.pooled = None
            self._num_pooling -= 1
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._requests[seq.request_id].finished.add(seq.sample_index)

    def _drop_pick_state(self, seq: Sequence) -> None:
        """Drops the sample's matcher and zeroes its token counts and settings: nothing of them outlives it."""
        seq.guide = seq.pick = None
        self.sampler.release(seq.seq_id)
        if seq.penalty_slot is not None:
            self.sampler.processors.slots.release(seq.penalty_slot)
            seq.penalty_slot = None

    def _token_outputs(self, sequences: list[Sequence]) -> list[TokenOutput]:
        """What each listed sample produced since its previous output, for those that have something."""
        outputs = []
        requests, finished = self._requests, SequenceStatus.FINISHED
        # A sample listed twice emits nothing the second time: its count of emitted tokens, or its final
        # delta, is recorded by the first.
        for seq in sequences:
            tokens, sent = seq.output_token_ids, seq.emitted_token_count
            if seq.status is not finished:  # its request is live and its own: released only once all ended
                if sent < len(tokens):
                    seq.emitted_token_count = len(tokens)
                    outputs.append((seq.request_id, seq.sample_index, tokens[sent:],
                                    seq.logprobs[sent:] if seq.logprobs else (), None, None))
                continue
            request = requests.get(seq.request_id)
            # Ids are reused once released: a sample of an ended request still listed in a step in flight
            # finds a newer request under its id, and must not speak for it.
            if request is None or seq.sample_index in request.emitted_final or seq not in request.sequences:
                continue
            seq.emitted_token_count = len(tokens)
            request.emitted_final.add(seq.sample_index)
            outputs.append((seq.request_id, seq.sample_index, tokens[sent:], seq.logprobs[sent:],
                            seq.finish_reason, self._release_if_done(request)))
        return outputs

    def _release_if_done(self, request: Request) -> RequestMetrics | None:
        """Forgets the request once every sample's last delta is out; that delta carries the metrics."""
        if any(s.forks_pending for s in request.sequences) or len(request.emitted_final) < len(request.sequences):
            return None
        del self._requests[request.request_id]
        return RequestMetrics(
            prompt_tokens=request.num_prompt_tokens,
            output_tokens=sum(len(s.output_token_ids) for s in request.sequences),
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finish_time=time.monotonic(),
        )


def _embeddings_download(vectors: torch.Tensor | None) -> DownloadPlan:
    """A step's download plan holding its finished embeddings' vectors, if any: zeroed in the bridge once read."""
    download = DownloadPlan()
    if vectors is not None:
        download.add(EMBEDDINGS, vectors)
    return download


def _skip_scrub(block_ids: list[int]) -> None:
    """Used only when a benchmark measures what zeroing costs."""
