"""Serving the gateway application with uvicorn: no access log, no server or date header.

`serve` binds the listening socket itself (so that port 0 yields a known
port), writes the port file atomically once uvicorn is serving, and returns 0
when SIGINT or SIGTERM has stopped the server cleanly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.errors import GatewayError
from gateway.settings import GatewaySettings, parse_address

if TYPE_CHECKING:
    import uvicorn


class GatewayStartError(Exception):
    """The gateway cannot start; the message says why and what to change."""


def uvicorn_config_options() -> dict[str, object]:
    """The uvicorn options that keep the server from recording or revealing anything about callers."""
    return {
        "access_log": False,
        "server_header": False,
        "date_header": False,
        "proxy_headers": False,
        "log_level": "warning",
        "log_config": None,
        "lifespan": "on",
    }


def serve(settings: GatewaySettings) -> int:
    """Run the gateway for `settings` until it is stopped; raise GatewayStartError on bad configuration."""
    import uvicorn

    from audit.errors import AuditError
    from gateway.app import create_app
    from policy import PolicyError

    _configure_logging()
    try:
        app = create_app(settings)
    except (PolicyError, AuditError, GatewayError) as error:
        raise GatewayStartError(str(error)) from None
    if app.state.runtime.pool.policy.is_development:
        print(f"veil gateway: WARNING policy {app.state.runtime.pool.policy.name!r} admits nodes with SIMULATED "
              "attestation; nothing protects user data on them. Development only.", file=sys.stderr)
    sock = bind_listener(settings.listen)
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_config_options()))
    # uvicorn stops cleanly on SIGINT/SIGTERM and then re-raises the signal to the handler it
    # found; this one makes that a normal exit (status 0) instead of death by signal.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, _stopped_by_signal)
    return asyncio.run(_serve(server, sock, settings.port_file))


def _stopped_by_signal(signum: int, frame: object) -> None:
    """The server has already shut down when this runs; nothing is left to do."""


async def _serve(server: uvicorn.Server, sock: socket.socket, port_file: Path | None) -> int:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        await task
        return 1
    host, port = sock.getsockname()[:2]
    if port_file is not None:
        write_port_file(port_file, port)
    print(f"veil gateway: serving on {host}:{port}", file=sys.stderr, flush=True)
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
        raise GatewayStartError(f"cannot listen on {listen} ({error.strerror}); choose another address") from None
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def write_port_file(path: Path, port: int) -> None:
    """Write `port` to `path` atomically (readers never see a partial file)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(f"{port}\n", encoding="ascii")
    os.replace(temporary, path)


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name, level in (("veil.gateway", logging.INFO), ("uvicorn.error", logging.WARNING)):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
