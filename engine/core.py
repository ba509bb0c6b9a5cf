"""The engine core: a process of its own that owns the model and steps it, and nothing else.

A node's serving side (gRPC threads, decryption, JSON, streaming) and the step loop used to share one
interpreter lock, so every handler's Python work stalled the GPU between steps. Here the loop runs
alone in a child process and talks to its client (`engine.core_client`) over one pipe: requests,
aborts, samples to stop and queries in; each step's token outputs, refusals and zeroing reports out.
The loop makes no text: its client detokenizes, finds stop strings and holds text back
(`engine.output_processor`), and asks it to stop a sample whose text met a stop string.

A request with a constraint (structured outputs) is compiled on a worker thread and joins the loop
when its matcher is ready: a compile can take llguidance's whole fuel (~20 ms), and on the loop it
would hold every running request's next step that long. llguidance releases the interpreter lock
while it compiles, so the steps go on meanwhile. An abort before then drops the compile unread.

The process is spawned, never forked: a fork would copy the parent's memory, keys included, into a
process that needs none of it. The pipe is an in-memory socket pair; nothing is written to disk, and
no message carries more than the request itself and its output.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.accounting import ZeroingAccount, ZeroingReport
from engine.config import EngineConfig
from engine.errors import EngineError, ModelLoadError, UnknownRequestError
from engine.llm_engine import LLMEngine, duplicate_request_id
from engine.outputs import TokenOutput
from engine.pooling import EmbeddingOutput, PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured import Guide

# How long an idle core waits for a message before it looks at its clocks again.
_IDLE_POLL_S = 0.05
# While a constraint compiles and nothing else runs, how often the loop looks whether it is ready.
_COMPILE_POLL_S = 0.002
# Threads compiling constraints: two keep one long compile from holding every other constrained request.
_COMPILE_WORKERS = 2
# Residue found is reported within this; everything else waits for the node's own cadence anyway.
ZEROING_REPORT_INTERVAL_S = 0.25


# ----- client -> core ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    pooling: PoolingParams | None = None  # an embedding request (`engine.pooling`): `params` unused


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class FinishSample:
    """Stop one sample: a stop string ended its text. Its blocks are freed and zeroed at once."""

    request_id: str
    index: int


@dataclass(frozen=True, slots=True)
class Query:
    """A question answered by an `Answer` with the same call id."""

    call_id: int
    name: str  # "residue_check" (free blocks holding any byte) or "zeroing" (a report now)


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


# ----- core -> client ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CoreReady:
    """Sent once the model is loaded: what the serving side needs to know of it."""

    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    device: str


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The core could not start; `message` is the engine's own (sizes and names, never content)."""

    message: str
    model_error: bool


@dataclass(frozen=True, slots=True)
class StepOutput:
    outputs: list[TokenOutput]  # tuples: cheap to pickle, one per sample that produced or ended
    embeddings: list[EmbeddingOutput] = dataclasses.field(default_factory=list)  # embedding requests that ended


@dataclass(frozen=True, slots=True)
class Refused:
    """A request the engine refused or failed; it holds nothing of it any more."""

    request_id: str
    error: EngineError


@dataclass(frozen=True, slots=True)
class Answer:
    call_id: int
    value: object


ToCore = AddRequest | AbortRequest | FinishSample | Query | Shutdown


def run_core(model_dir: str, config: EngineConfig, connection: Connection) -> None:
    """The child process's entry point: load, say so, serve until told to stop or the client is gone."""
    # Ctrl-C reaches the whole process group; the client stops this process itself (or its pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = LLMEngine(model_dir, dataclasses.replace(config, detokenize=False))
    except ModelLoadError as error:
        connection.send(CoreFailed(str(error), model_error=True))
        return
    except Exception as error:  # noqa: BLE001 - the client must hear why, not a dead pipe
        connection.send(CoreFailed(f"the engine could not start ({type(error).__name__})", model_error=False))
        return
    runner = engine.runner
    connection.send(CoreReady(engine.max_model_len, runner.num_blocks, runner.block_size,
                              engine.model_config.vocab_size, str(runner.device)))
    EngineCore(engine, connection).run()


@dataclass(frozen=True, slots=True)
class _Compiling:
    """A constrained request whose matcher a worker thread is making; it joins the engine once made."""

    message: AddRequest
    matcher: Future[Guide | None]


class EngineCore:
    """The step loop: takes what the pipe brings between steps, steps while any request is unfinished."""

    def __init__(self, engine: LLMEngine, connection: Connection) -> None:
        self.engine = engine
        self._connection = connection
        self._zeroing = ZeroingAccount(engine.block_manager, engine.runner)
        self._live: set[str] = set()  # requests added and not yet ended
        self._compiling: dict[str, _Compiling] = {}  # constrained requests not yet added, by id
        self._compiler: ThreadPoolExecutor | None = None  # started at the first constrained request
        self._steps = 0
        self._last_report = time.monotonic()
        self._running = True

    def run(self) -> None:
        try:
            while self._running:
                self._take_messages(wait=not self.engine.has_unfinished())
                self._add_compiled()
                if self._running and self.engine.has_unfinished():
                    self._step()
                self._report_zeroing_if_due()
            self._send(self._zeroing.take(self._steps))  # the last tally reaches the audit too
        except (EOFError, OSError):
            pass  # the client is gone: so is every request, and this process with them
        except Exception:  # noqa: BLE001 - end quietly: a traceback on stderr is no channel for anything
            pass  # the client sees the pipe close and fails every request still waiting
        finally:
            self._compiling.clear()  # no compiled matcher outlives the loop
            if self._compiler is not None:
                self._compiler.shutdown(wait=False, cancel_futures=True)

    # ----- messages ---------------------------------------------------------------------------

    def _take_messages(self, wait: bool) -> None:
        if wait and not self._connection.poll(_COMPILE_POLL_S if self._compiling else _IDLE_POLL_S):
            return
        while self._running and self._connection.poll():
            self._handle(self._connection.recv())

    def _handle(self, message: ToCore) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequest):
            self._abort(message.request_id)
        elif isinstance(message, FinishSample):
            if message.request_id in self._live:  # else it ended meanwhile: nothing left to stop
                self.engine.finish_sample(message.request_id, message.index)
        elif isinstance(message, Query):
            try:
                value = self._answer(message.name)
            except Exception:  # noqa: BLE001 - the asker hears of it; the loop lives on
                value = EngineError(f"the engine could not answer {message.name!r}")
            self._send(Answer(message.call_id, value))
        elif isinstance(message, Shutdown):
            self._running = False

    def _add(self, message: AddRequest) -> None:
        if message.request_id in self._compiling:  # the engine refuses a running one's id itself
            self._send(Refused(message.request_id, duplicate_request_id()))
        elif message.params.structured is None:
            self._add_to_engine(message, None)
        else:
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="veil-constraints")
            matcher = self._compiler.submit(self.engine.compile_constraint, message.params)
            self._compiling[message.request_id] = _Compiling(message, matcher)

    def _add_compiled(self) -> None:
        """Adds each constrained request whose matcher is made (or refuses it, if it could not be)."""
        for request_id in [key for key, compiling in self._compiling.items() if compiling.matcher.done()]:
            compiling = self._compiling.pop(request_id)
            try:
                matcher = compiling.matcher.result()
            except EngineError as error:
                self._send(Refused(request_id, error))
            except Exception:  # noqa: BLE001 - no request may end the step loop
                self._send(Refused(request_id, EngineError("the engine refused this request")))
            else:
                self._add_to_engine(compiling.message, matcher)

    def _add_to_engine(self, message: AddRequest, compiled: Guide | None) -> None:
        try:
            if message.pooling is not None:
                self.engine.add_embedding(message.prompt, message.pooling, request_id=message.request_id)
            else:
                self.engine.add_request(message.prompt, message.params, request_id=message.request_id,
                                        compiled=compiled)
        except EngineError as error:
            self._send(Refused(message.request_id, error))
            return
        except Exception:  # noqa: BLE001 - no request may end the step loop
            self._send(Refused(message.request_id, EngineError("the engine refused this request")))
            return
        self._live.add(message.request_id)

    def _abort(self, request_id: str) -> None:
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:  # never added: its matcher, made or not, is dropped unread
            compiling.matcher.cancel()
            return
        if request_id not in self._live:
            return  # it ended in the meantime; its deltas are on their way and will be dropped
        self._live.discard(request_id)
        self._zeroing.request_ended()
        try:
            self.engine.abort(request_id)
        except UnknownRequestError:
            pass

    def _answer(self, name: str) -> object:
        if name == "residue_check":
            return self.engine.residue_check()
        if name == "zeroing":
            self._last_report = time.monotonic()
            return self._zeroing.take(self._steps)
        raise EngineError(f"unknown query {name!r}")

    # ----- stepping ---------------------------------------------------------------------------

    def _step(self) -> None:
        try:
            outputs = self.engine.step_tokens()
        except Exception:  # noqa: BLE001 - one broken step must not take the node down silently
            self._fail_all()
            return
        self._steps += 1
        embeddings = self.engine.take_embeddings()
        ended = [output[0] for output in outputs if output[5] is not None]  # the request's metrics: it ended
        for request_id in ended + [embedded.request_id for embedded in embeddings]:
            if request_id in self._live:
                self._live.discard(request_id)
                self._zeroing.request_ended()
        if outputs or embeddings:
            self._send(StepOutput(outputs, embeddings))
        self._zeroing.check()

    def _fail_all(self) -> None:
        """Fails every request in flight with a generic error and frees (and zeroes) what it held."""
        for request_id in sorted(self._live):
            self._zeroing.request_ended()
            try:
                self.engine.abort(request_id)
            except EngineError:
                pass
            self._send(Refused(request_id, EngineError("the engine failed while serving this request")))
        self._live.clear()

    def _report_zeroing_if_due(self) -> None:
        now = time.monotonic()
        if now - self._last_report < ZEROING_REPORT_INTERVAL_S:
            return
        self._last_report = now
        self._zeroing.check()
        if self._zeroing.pending:
            # While steps run, their downloads carry the residue count: no crossing of the report's own.
            self._send(self._zeroing.take(self._steps, exact=not self.engine.has_unfinished()))

    def _send(self, message: StepOutput | Refused | Answer | ZeroingReport) -> None:
        self._connection.send(message)
