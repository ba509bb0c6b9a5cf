"""Serving a Veil application with uvicorn (the gateway, the relay, the issuer, the log and the witness):
no access log, no server or date header, bounded reads.

`serve_app` binds the listening socket itself (so that port 0 yields a known
port), writes the port file atomically once uvicorn is serving, and returns 0
when SIGINT or SIGTERM has stopped the server cleanly.

uvicorn bounds an idle keep-alive connection and the size of a request head,
but not how long a client may take to send its head or its body: a client
sending a byte now and then would hold its connection (and, past the
connection cap, everyone's) forever. `DeadlineH11Protocol` gives each request
a deadline for its head and one for its body, closing the connection (with a
408 when no answer has begun) when either passes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from audit.logs import ensure_logging
from serving.errors import RequestTimeoutError
from serving.settings import Listening, parse_address

if TYPE_CHECKING:
    import uvicorn

_log = logging.getLogger("veil.server")


class ServerStartError(Exception):
    """A server cannot start; the message says why and what to change."""


_TIMED_OUT = RequestTimeoutError("the request did not arrive within the gateway's timeouts; send it again in one go")
_TIMEOUT_BODY = json.dumps(_TIMED_OUT.body()).encode()
# Written below the application (no request was handed to it, or it is still reading the body).
REQUEST_TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY
)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's head and one for its body.

    The head deadline runs from the connection's start, or from the first byte of a later request,
    until the head is complete; the body deadline from then until the body is. Waiting for a next
    request is uvicorn's keep-alive timeout; sending the answer is not bounded (answers stream).
    """

    def __init__(self, *args: Any, header_timeout_s: float, body_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Keyed by the client's h11 state while that part is being read: IDLE until the head is whole.
        self._timeouts: dict[object, float] = {h11.IDLE: header_timeout_s, h11.SEND_BODY: body_timeout_s}
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_for: object = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(h11.IDLE)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm(h11.IDLE)  # the first byte of a next request: its head is on the clock
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()  # a pipelined request may have been read just now

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        """Keep the deadline of the part of the request being read: head, body, or none once read."""
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._deadline_for is not h11.SEND_BODY:
            self._arm(h11.SEND_BODY)
        elif state not in self._timeouts:
            self._disarm()

    def _arm(self, state: object) -> None:
        self._disarm()
        self._deadline_for = state
        self._deadline = self.loop.call_later(self._timeouts[state], self._too_slow, state)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._deadline_for = None

    def _too_slow(self, state: object) -> None:
        self._deadline = self._deadline_for = None
        if self.transport.is_closing():
            return
        # A head that never completed has no answer yet; a body's request may already have one
        # (refused early), and then only the connection is closed.
        if state is h11.IDLE or not self.cycle.response_started:
            self.transport.write(REQUEST_TIMEOUT_ANSWER)
        self.transport.close()


def uvicorn_config_options(settings: Listening) -> dict[str, object]:
    """The uvicorn options that keep the server from recording or revealing anything about callers,
    and that bound what one connection can hold (`settings`: timeouts and the connection cap)."""
    protocol = functools.partial(DeadlineH11Protocol, header_timeout_s=settings.header_timeout_s,
                                 body_timeout_s=settings.body_timeout_s)
    return {
        "access_log": False,
        "server_header": False,
        "date_header": False,
        "proxy_headers": False,
        "log_level": "warning",
        "log_config": None,
        "lifespan": "on",
        "http": protocol,
        "timeout_keep_alive": settings.keep_alive_s,
        # Past this many open connections, uvicorn answers each new request 503 and closes it.
        "limit_concurrency": settings.max_connections,
    }


def serve_app(app: Any, settings: Listening, *, name: str) -> int:
    """Serve `app` on `settings.listen` with Veil's uvicorn options until stopped."""
    import uvicorn

    ensure_logging()
    sock = bind_listener(settings.listen)
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_config_options(settings)))
    # uvicorn stops cleanly on SIGINT/SIGTERM and then re-raises the signal to the handler it
    # found; this one makes that a normal exit (status 0) instead of death by signal.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, _stopped_by_signal)
    return asyncio.run(_serve(server, sock, settings.port_file, name))


def _stopped_by_signal(signum: int, frame: object) -> None:
    """The server has already shut down when this runs; nothing is left to do."""


async def _serve(server: uvicorn.Server, sock: socket.socket, port_file: Path | None, name: str) -> int:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        await task
        return 1
    host, port = sock.getsockname()[:2]
    if port_file is not None:
        write_port_file(port_file, port)
    _log.info("%s: serving on %s:%s", name, host, port)
    await task
    return 0


def bind_listener(listen: str) -> socket.socket:
    """A listening TCP socket on `listen` (HOST:PORT; port 0 picks a free one)."""
    host, port = parse_address(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so (accepted
    # sockets inherit it), and without it every response waits ~40 ms on a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ServerStartError(f"cannot listen on {listen} ({error.strerror}); choose another address") from None
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def write_port_file(path: Path, port: int) -> None:
    """Write `port` to `path` atomically (readers never see a partial file)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(f"{port}\n", encoding="ascii")
    os.replace(temporary, path)
