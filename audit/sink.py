"""Audit sinks: where validated events go.

`JsonLinesSink` writes one JSON object per line to a file or a stream from a
background thread. `emit` only validates the event and puts it in a bounded
queue, so inference never waits on audit I/O: when the queue is full the event
is dropped and counted, and the count is written as an `EventsDropped` event.
The writer flushes at least once a second (and fsyncs files), so a crash loses
at most the last second of events.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from audit.errors import AuditSinkError
from audit.events import AuditEvent, AuditRecord, EventsDropped, record_of_validated, to_record, validate_event

DEFAULT_QUEUE_SIZE = 10_000
DEFAULT_FLUSH_INTERVAL_S = 1.0
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))
# How long close() and flush() wait for the writer before giving up.
WRITER_WAIT_S = 5.0


class AuditSink(Protocol):
    """Receives audit events. `emit` must never block the caller on I/O."""

    def emit(self, event: AuditEvent) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Validates events and discards them (audit disabled by policy)."""

    def emit(self, event: AuditEvent) -> None:
        validate_event(event)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class MemorySink:
    """Keeps validated events and their stored form in memory, for tests."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        self._events: list[AuditRecord] = []

    def emit(self, event: AuditEvent) -> None:
        record = to_record(event, self._clock())
        with self._lock:
            self._records.append(record)
            self._events.append(AuditRecord(ts=record["ts"], event=event))

    @property
    def records(self) -> list[dict[str, Any]]:
        """The JSON objects a JSON lines sink would have written, in emission order."""
        with self._lock:
            return list(self._records)

    @property
    def events(self) -> list[AuditEvent]:
        """The emitted events, in emission order."""
        with self._lock:
            return [record.event for record in self._events]

    @property
    def audit_records(self) -> list[AuditRecord]:
        """The emitted events with their coarse timestamps (what reports consume)."""
        with self._lock:
            return list(self._events)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(slots=True)
class _FlushRequest:
    done: threading.Event = field(default_factory=threading.Event)


_STOP = object()


class JsonLinesSink:
    """Writes events as JSON lines to a path or an open text stream, off the caller's thread."""

    def __init__(
        self,
        target: str | os.PathLike[str] | TextIO,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < flush_interval_s <= DEFAULT_FLUSH_INTERVAL_S:
            raise AuditSinkError("flush_interval_s must be in (0, 1] so a crash loses at most one second")
        self._stream, self._owns_stream = _open_target(target)
        self._flush_interval_s = flush_interval_s
        self._clock = clock
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._drop_lock = threading.Lock()
        self._dropped_total = 0
        self._dropped_reported = 0
        self._closed = False
        self._unflushed = False  # touched by the writer thread only
        self._writer = threading.Thread(target=self._write_loop, name="veil-audit-writer", daemon=True)
        self._writer.start()
        # Interpreter exit without close() would otherwise lose up to a second of events.
        atexit.register(self.close)

    @property
    def dropped(self) -> int:
        """How many events were dropped because the queue was full, since the sink opened."""
        return self._dropped_total

    def emit(self, event: AuditEvent) -> None:
        """Validate `event` and queue it; drop (and count) it if the queue is full."""
        validate_event(event)
        if self._closed:
            raise AuditSinkError("this audit sink is closed; open a new one")
        try:
            self._queue.put_nowait((self._clock(), event))
        except queue.Full:
            self._count_drop()

    def flush(self) -> None:
        """Block until every event emitted so far is written and flushed."""
        request = _FlushRequest()
        try:
            self._queue.put(request, timeout=WRITER_WAIT_S)
        except queue.Full:
            raise AuditSinkError("the audit writer is stuck; check the sink's file or stream") from None
        if not request.done.wait(WRITER_WAIT_S):
            raise AuditSinkError("the audit writer did not flush in time; check the sink's file or stream")

    def close(self) -> None:
        """Write everything queued, stop the writer, and close the file if the sink opened it."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._queue.put(_STOP, timeout=WRITER_WAIT_S)
        except queue.Full:
            pass  # the writer is stuck on I/O; it is a daemon and dies with the process
        self._writer.join(WRITER_WAIT_S)

    def __enter__(self) -> JsonLinesSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write_loop(self) -> None:
        next_flush = time.monotonic() + self._flush_interval_s
        while True:
            timeout = max(0.0, next_flush - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._flush_stream()
                if self._owns_stream:
                    self._stream.close()
                return
            if isinstance(item, _FlushRequest):
                self._flush_stream()
                item.done.set()
            elif item is not None:
                self._write(*item)
            if time.monotonic() >= next_flush:
                self._flush_stream()
                next_flush = time.monotonic() + self._flush_interval_s

    def _write(self, now: float, event: AuditEvent) -> None:
        # `emit` validated the event, and events are frozen: no need to check it twice.
        line = _COMPACT_JSON.encode(record_of_validated(event, now)) + "\n"
        try:
            self._stream.write(line)
            self._unflushed = True
        except (OSError, ValueError):
            # A failing disk or a closed stream must not kill the writer: the
            # event is lost, and counted like any other drop.
            self._count_drop()

    def _flush_stream(self) -> None:
        self._report_drops()
        if not self._unflushed:
            return  # an idle sink does not fsync every second
        self._unflushed = False
        try:
            self._stream.flush()
            if self._owns_stream:
                os.fsync(self._stream.fileno())
        except (OSError, ValueError):
            pass  # the next write fails too and is counted as dropped

    def _count_drop(self) -> None:
        with self._drop_lock:
            self._dropped_total += 1

    def _report_drops(self) -> None:
        with self._drop_lock:
            unreported = self._dropped_total - self._dropped_reported
            self._dropped_reported = self._dropped_total
        if unreported:
            self._write(self._clock(), EventsDropped(dropped=unreported))


def _open_target(target: str | os.PathLike[str] | TextIO) -> tuple[TextIO, bool]:
    if isinstance(target, (str, os.PathLike)):
        path = Path(target)
        try:
            # Owner-only: audit files hold no content, but nothing on a node is world-readable.
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as error:
            raise AuditSinkError(f"cannot open the audit file for appending ({error.strerror})") from None
        return os.fdopen(descriptor, "a", encoding="ascii"), True
    return target, False


SINK_FORMS = "an audit sink must be 'stdout', 'stderr', 'file:PATH', 'jsonl:PATH' or 'none'"
# A policy's `audit.sink` names a file as `jsonl:PATH`; the command line says `file:PATH`.
_FILE_PREFIXES = ("file:", "jsonl:")


def open_sink(spec: str) -> AuditSink:
    """A sink from its specification: `stdout`, `stderr`, `file:PATH` or `jsonl:PATH` (the same), or `none`."""
    if spec == "stdout":
        return JsonLinesSink(sys.stdout)
    if spec == "stderr":
        return JsonLinesSink(sys.stderr)
    if spec == "none":
        return NullSink()
    for prefix in _FILE_PREFIXES:
        if spec.startswith(prefix) and len(spec) > len(prefix):
            return JsonLinesSink(spec[len(prefix):])
    raise AuditSinkError(SINK_FORMS)
