"""Runs the engine on one thread and hands each request's deltas to whoever is waiting for them.

The engine is not thread-safe, so every call into it happens here; request handlers on the gRPC
threads submit work and read their own queue.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine import EngineError, LLMEngine, SamplingParams, StreamDelta, UnknownRequestError

_IDLE_WAIT_S = 0.05


@dataclass(frozen=True, slots=True)
class Failure:
    """Put on a request's queue instead of a delta when the engine refused or failed it."""

    error: EngineError


class RequestHandle:
    """One submitted request: iterate it for its deltas; close it to abort."""

    def __init__(self, worker: EngineWorker, request_id: str) -> None:
        self._worker = worker
        self.request_id = request_id
        self.queue: queue.Queue[StreamDelta | Failure | None] = queue.Queue()
        self.finished = False

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
        """Aborts the request if it is still running (its blocks are freed and zeroed at once)."""
        if not self.finished:
            self.finished = True
            self._worker.abort(self.request_id)


StepObserver = Callable[[LLMEngine, int], None]


class EngineWorker:
    def __init__(self, engine: LLMEngine, on_step: StepObserver | None = None) -> None:
        self.engine = engine
        self._on_step = on_step
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="veil-engine", daemon=True)
        self._ids = iter(range(1 << 62))
        self._id_lock = threading.Lock()
        self._requests_ended = 0  # finished, aborted or failed since take_requests_ended(); engine thread only

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def take_requests_ended(self) -> int:
        """How many requests ended (and released their blocks) since the last call; on the engine thread."""
        ended, self._requests_ended = self._requests_ended, 0
        return ended

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def submit(self, prompt: str | list[int], params: SamplingParams) -> RequestHandle:
        with self._id_lock:
            request_id = f"r{next(self._ids)}"
        handle = RequestHandle(self, request_id)

        def add() -> None:
            try:
                self.engine.add_request(prompt, params, request_id=request_id)
            except EngineError as error:
                handle.queue.put(Failure(error))
                return
            except Exception:  # noqa: BLE001 - no request may end the engine thread
                handle.queue.put(Failure(EngineError("the engine refused this request")))
                return
            self._handles[request_id] = handle

        self._send(add)
        return handle

    def abort(self, request_id: str) -> None:
        def abort_now() -> None:
            handle = self._handles.pop(request_id, None)
            if handle is not None:
                self._requests_ended += 1
                try:
                    self.engine.abort(request_id)
                except UnknownRequestError:
                    pass  # it finished in the meantime

        self._send(abort_now)

    def call(self, function: Callable[[LLMEngine], object]) -> object:
        """Runs `function(engine)` on the engine thread and returns its result (for checks and stats)."""
        result: queue.Queue = queue.Queue(maxsize=1)

        def run() -> None:
            try:
                result.put((True, function(self.engine)))
            except Exception as error:  # noqa: BLE001 - handed back to the caller's thread
                result.put((False, error))

        self._send(run)
        ok, value = result.get(timeout=30)
        if not ok:
            raise value
        return value

    def _send(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        step = 0
        while not self._stopping.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                deltas = self.engine.step()
            except Exception:  # noqa: BLE001 - one broken step must not take the node down silently
                self._fail_all()
                continue
            for delta in deltas:
                self._deliver(delta)
            step += 1
            if self._on_step is not None:
                self._on_step(self.engine, step)
        for handle in list(self._handles.values()):
            handle.queue.put(None)

    def _fail_all(self) -> None:
        """Fails every request in flight with a generic error and frees (and zeroes) what it held."""
        for request_id, handle in list(self._handles.items()):
            self._requests_ended += 1
            handle.queue.put(Failure(EngineError("the engine failed while serving this request")))
            try:
                self.engine.abort(request_id)
            except EngineError:
                pass
        self._handles.clear()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # noqa: BLE001 - commands answer their callers themselves; the loop must live
                continue

    def _deliver(self, delta: StreamDelta) -> None:
        handle = self._handles.get(delta.request_id)
        if handle is None:
            return  # aborted: nobody is listening
        handle.queue.put(delta)
        if delta.request_finished:
            del self._handles[delta.request_id]
            self._requests_ended += 1
