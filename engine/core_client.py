"""The serving side's handle on the engine core process: submit requests, read their deltas.

`EngineCoreClient.start` spawns the core (`engine.core`) and waits until its model is loaded. Any
number of threads may then `submit`; each gets a `RequestHandle` to iterate for its deltas and close
to abort. One reader thread takes everything the core sends, makes each step's token outputs into
deltas (the text stage, `engine.output_processor`: off the core's step loop, as in vLLM V1) and puts
each on its request's queue, so handlers never touch the pipe's receiving end and the core never
waits for a handler. A stop string the text stage finds is sent back: the core stops that sample.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.accounting import ZeroingReport
from engine.config import EngineConfig
from engine.core import (
    AbortRequest,
    AddRequest,
    Answer,
    CoreFailed,
    CoreReady,
    FinishSample,
    Query,
    Refused,
    Shutdown,
    StepOutput,
    ToCore,
    run_core,
)
from engine.errors import EngineError, ModelLoadError
from engine.output_processor import OutputProcessor
from engine.outputs import StreamDelta
from engine.pooling import EmbeddingOutput, PoolingParams
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

# Loading a large model from a slow disk takes minutes; an engine that never answers must still fail.
START_TIMEOUT_S = 900.0
QUERY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Failure:
    """Put on a request's queue instead of a delta when the engine refused or failed it."""

    error: EngineError


class RequestHandle:
    """One submitted request: iterate it for its deltas; close it to abort."""

    def __init__(self, client: EngineCoreClient, request_id: str) -> None:
        self._client = client
        self.request_id = request_id
        self.queue: queue.Queue[StreamDelta | EmbeddingOutput | Failure | None] = queue.Queue()
        self.finished = False

    def embedding(self) -> EmbeddingOutput:
        """An embedding request's vector, once the engine has pooled it; raises the engine's error if refused."""
        item = self.queue.get()
        self.finished = True
        if isinstance(item, EmbeddingOutput):
            return item
        raise item.error if isinstance(item, Failure) else EngineError("the engine stopped before this request finished")

    def deltas(self) -> Iterator[StreamDelta]:
        """Yields deltas until the request finishes; raises the engine's error if it was refused."""
        for batch in self.delta_batches():
            yield from batch

    def delta_batches(self) -> Iterator[list[StreamDelta]]:
        """Like `deltas`, but each item holds every delta already waiting (at least one).

        A reader that fell behind the engine (a slow network, a busy host) catches up in one
        send instead of one per token, so per-message costs shrink exactly when they hurt.
        """
        while not self.finished:
            batch: list[StreamDelta] = []
            for item in self._waiting():
                if item is None or isinstance(item, Failure):
                    if batch:
                        yield batch  # what the engine produced before failing still reaches its reader
                    self.finished = isinstance(item, Failure)
                    raise item.error if isinstance(item, Failure) else EngineError(
                        "the engine stopped before this request finished")
                batch.append(item)
                self.finished = self.finished or item.request_finished
            yield batch

    def _waiting(self) -> list[StreamDelta | Failure | None]:
        """Blocks for one item, then takes whatever else is already queued (this is the only reader)."""
        items = [self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def close(self) -> None:
        """Aborts the request if it is still running (the core frees and zeroes its blocks at once)."""
        if not self.finished:
            self.finished = True
            self._client.abort(self.request_id)


ZeroingObserver = Callable[[ZeroingReport], None]


class EngineCoreClient:
    """Starts, feeds and stops one engine core process."""

    def __init__(
        self, model_dir: str | Path, config: EngineConfig | None = None, on_zeroing: ZeroingObserver | None = None
    ) -> None:
        self.model_dir = str(model_dir)
        self.config = config or EngineConfig()
        self._on_zeroing = on_zeroing
        self._on_exit: list[Callable[[], None]] = []
        self._handles: dict[str, RequestHandle] = {}
        self._answers: dict[int, queue.Queue[object]] = {}
        self._lock = threading.Lock()  # guards the pipe's sending end, the handles and the answers
        self._ids = itertools.count()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection = None
        self._reader: threading.Thread | None = None
        self._unobserved = ZeroingReport(0, 0, 0, 0)  # the core's reports while nobody observes them
        self._reading = False  # whether the reader still takes the core's messages; guarded by the lock
        self._text: OutputProcessor | None = None  # the text stage, run on the reader thread
        self.info: CoreReady | None = None
        self.alive = False

    # ----- life -------------------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> CoreReady:
        """Spawns the core and returns once its model is loaded; raises the engine's error if it cannot be."""
        # The tokenizer first: a folder without one fails here (ModelLoadError) before a process is spawned.
        self._text = OutputProcessor(Tokenizer(self.model_dir))
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        self._process = context.Process(
            target=run_core, args=(self.model_dir, self.config, theirs), name="veil-engine-core", daemon=True
        )
        self._process.start()
        theirs.close()
        self._connection = ours
        self.info = self._await_ready(timeout_s)
        self.alive = True
        self._reading = True
        self._reader = threading.Thread(target=self._read, name="veil-engine-reader", daemon=True)
        self._reader.start()
        return self.info

    def _await_ready(self, timeout_s: float) -> CoreReady:
        try:
            if not self._connection.poll(timeout_s):
                raise EngineError(f"the engine did not load its model within {timeout_s:.0f} s")
            message = self._connection.recv()
        except (EOFError, OSError):
            message = CoreFailed("the engine process exited while loading the model", model_error=False)
        except EngineError:
            self._end_process()
            raise
        if isinstance(message, CoreReady):
            return message
        self._end_process()
        raise (ModelLoadError if message.model_error else EngineError)(message.message)

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Calls `callback` (on the reader thread) if the core ends while the client still wanted it."""
        self._on_exit.append(callback)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stops the core after its last zeroing report; requests still running end with an error."""
        if self._process is None:
            return
        self.alive = False
        try:
            self._send(Shutdown())
        except (OSError, EngineError):
            pass
        if self._reader is not None:
            self._reader.join(timeout_s)
        self._end_process(timeout_s)

    def _end_process(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        process, self._process = self._process, None
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join()
        self._connection.close()

    @property
    def max_model_len(self) -> int:
        if self.info is None:
            raise EngineError("the engine is not running")
        return self.info.max_model_len

    # ----- requests ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def submit(self, prompt: str | list[int], params: SamplingParams, pooling: PoolingParams | None = None
               ) -> RequestHandle:
        """Queues a request; with `pooling`, an embedding request, whose handle's `embedding` is its answer."""
        refusal = None
        try:
            prompt = self._tokenized(prompt)
        except EngineError as error:
            refusal = error
        with self._lock:
            handle = RequestHandle(self, f"r{next(self._ids)}")
            if refusal is not None or not self._reading:  # nobody would ever end it
                handle.queue.put(Failure(refusal or EngineError("the engine is not running")))
                return handle
            # Listed before the core can answer, so no output can arrive for a request nobody holds.
            self._handles[handle.request_id] = handle
            if pooling is None:  # an embedding makes no text
                self._text.add(handle.request_id, params, prompt if isinstance(prompt, list) else ())
        try:
            self._send(AddRequest(handle.request_id, prompt, params, pooling))
        except EngineError as error:
            self._handles.pop(handle.request_id, None)
            self._text.forget(handle.request_id)
            handle.queue.put(Failure(error))
        return handle

    def _tokenized(self, prompt: str | list[int]) -> str | list[int]:
        """A text prompt as the core would tokenize it, tokenized here (as vLLM's front end does): the text
        stage's first decode starts with its last tokens, and the core's step loop never waits on a tokenizer.
        An empty text goes as it is, for the core to refuse."""
        if isinstance(prompt, str) and prompt and self._text is not None:
            return self._text.tokenizer.encode(prompt)
        return prompt

    def abort(self, request_id: str) -> None:
        if self._handles.pop(request_id, None) is None:
            return
        self._text.forget(request_id)
        try:
            self._send(AbortRequest(request_id))
        except EngineError:
            pass  # no core, no request

    # ----- queries ----------------------------------------------------------------------------

    def residue_check(self) -> list[int]:
        """Free blocks holding any non-zero byte, checked where they lie (must always be empty)."""
        return self._query("residue_check")

    def take_zeroing(self) -> ZeroingReport:
        """The zeroing tally now, instead of at the core's cadence: everything since the last report the
        observer received, or, without an observer, since the last call."""
        now = self._query("zeroing")
        with self._lock:
            taken, self._unobserved = self._unobserved, ZeroingReport(0, 0, 0, now.step)
        return taken.plus(now)

    def _query(self, name: str) -> object:
        answer: queue.Queue[object] = queue.Queue(maxsize=1)
        with self._lock:
            if not self._reading:  # nobody would ever answer
                raise EngineError("the engine is not running")
            call_id = next(self._ids)
            self._answers[call_id] = answer
        try:
            self._send(Query(call_id, name))
            value = answer.get(timeout=QUERY_TIMEOUT_S)
            if isinstance(value, EngineError):
                raise value
            return value
        except queue.Empty:
            raise EngineError(f"the engine did not answer within {QUERY_TIMEOUT_S:.0f} s") from None
        finally:
            self._answers.pop(call_id, None)

    # ----- the pipe ---------------------------------------------------------------------------

    def _send(self, message: ToCore) -> None:
        with self._lock:
            if self._connection is None or self._connection.closed:
                raise EngineError("the engine is not running")
            try:
                self._connection.send(message)
            except OSError:
                raise EngineError("the engine is not running") from None

    def _read(self) -> None:
        try:
            while True:
                self._dispatch(self._connection.recv())
        except (EOFError, OSError):
            pass
        finally:
            self._core_ended()

    def _dispatch(self, message: StepOutput | Refused | Answer | ZeroingReport) -> None:
        if isinstance(message, StepOutput):
            deltas, stops = self._text.process(message.outputs)
            for delta in deltas:
                self._deliver(delta)
            for request_id, index in stops:
                self._finish_sample(request_id, index)
            for embedded in message.embeddings:
                handle = self._handles.pop(embedded.request_id, None)
                if handle is not None:  # else closed: nobody is listening
                    handle.queue.put(embedded)
        elif isinstance(message, Refused):
            self._text.forget(message.request_id)
            handle = self._handles.pop(message.request_id, None)
            if handle is not None:
                handle.queue.put(Failure(message.error))
        elif isinstance(message, Answer):
            waiting = self._answers.get(message.call_id)
            if waiting is not None:
                waiting.put(message.value)
        elif isinstance(message, ZeroingReport):
            self._observe(message)

    def _observe(self, report: ZeroingReport) -> None:
        if self._on_zeroing is not None:
            self._on_zeroing(report)
            return
        with self._lock:
            self._unobserved = self._unobserved.plus(report)

    def _finish_sample(self, request_id: str, index: int) -> None:
        """Asks the core to stop a sample a stop string ended; its last delta comes once the core has."""
        try:
            self._send(FinishSample(request_id, index))
        except EngineError:
            pass  # no core: the request ends with the pipe

    def _deliver(self, delta: StreamDelta) -> None:
        handle = self._handles.get(delta.request_id)
        if handle is None:
            return  # aborted: nobody is listening
        handle.queue.put(delta)
        if delta.request_finished:
            self._handles.pop(delta.request_id, None)

    def _core_ended(self) -> None:
        """Every request and query still waiting ends with an error; whoever asked is told if this was unplanned."""
        unplanned = self.alive
        self.alive = False
        with self._lock:
            self._reading = False  # from here on nothing waits: submit and _query refuse at once
            handles, self._handles = list(self._handles.values()), {}
            answers, self._answers = list(self._answers.values()), {}
            self._text.clear()  # nothing of a request outlives it
        for handle in handles:
            handle.queue.put(None)
        for answer in answers:
            try:
                answer.put_nowait(EngineError("the engine stopped before it answered"))
            except queue.Full:
                pass  # its answer came first
        if unplanned:
            for callback in self._on_exit:
                callback()
