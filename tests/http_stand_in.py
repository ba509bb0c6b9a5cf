"""A web application served by a real uvicorn server on loopback, in a thread: for stand-ins of a gateway."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from tests.conftest import HANG_S


@contextlib.contextmanager
def served(app: FastAPI) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 (a free port) while the block runs; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(HANG_S)


@contextlib.contextmanager
def environment(name: str, value: str) -> Iterator[None]:
    """Set one environment variable while the block runs (module-scoped fixtures cannot monkeypatch)."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
