"""What serving takes, for every Veil server: where to listen, and how long and how many connections may hold it."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from serving.errors import SettingsError

_ADDRESS = re.compile(r"(?P<host>[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>[0-9]{1,5})", re.ASCII)

# The bounds of a server that forwards requests (the gateway, the relay): a request body's size, requests
# in flight, and the Retry-After of a 503 at that bound.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_IN_FLIGHT = 256
RETRY_AFTER_S = 1


class Listening(Protocol):
    """What serving reads of a server's settings: `ServerSettings`, or a party's own that carry the same fields."""

    @property
    def listen(self) -> str: ...
    @property
    def port_file(self) -> Path | None: ...
    @property
    def header_timeout_s(self) -> float: ...
    @property
    def body_timeout_s(self) -> float: ...
    @property
    def keep_alive_s(self) -> float: ...
    @property
    def max_connections(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The listen address, the port file and the connection bounds `serving.server.serve_app` serves with.

    `GatewaySettings` carries the same fields under the same names, and is served as it is.
    """

    listen: str = "127.0.0.1:0"
    port_file: Path | None = None
    # How long a client may take to send a request's head, and then its body; past either the
    # connection is closed (with 408), so a client sending a byte now and then holds nothing.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    # How long an idle connection is kept open for a next request.
    keep_alive_s: float = 5.0
    # Open connections past this many get 503 for each request, and are closed.
    max_connections: int = 1024

    def __post_init__(self) -> None:
        check_server_settings(self)



def check_server_settings(settings: Listening) -> None:
    """Raise SettingsError, naming the field, if the listen address or a connection bound is invalid."""
    parse_address(settings.listen)
    for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
        if not getattr(settings, name) > 0:
            raise SettingsError(f"{name} must be a positive number of seconds")
    if settings.max_connections < 1:
        raise SettingsError("max_connections must be at least 1")


def parse_address(address: str) -> tuple[str, int]:
    """Split `host:port`, or raise SettingsError saying what form is expected."""
    match = _ADDRESS.fullmatch(address)
    if match is None or not 0 <= int(match["port"]) <= 65535:
        raise SettingsError("a node or listen address must look like HOST:PORT (for example 127.0.0.1:7001)")
    return match["host"].strip("[]"), int(match["port"])


SERVER_DEFAULTS = ServerSettings()


def add_connection_limits(parser: argparse.ArgumentParser) -> None:
    """The slow-client bounds every Veil HTTP server takes (gateway, relay, issuer): head and body deadlines
    and a cap on open connections."""
    parser.add_argument("--header-timeout-s", type=float, default=SERVER_DEFAULTS.header_timeout_s,
                        help="close a connection whose request head takes longer (default: %(default)s)")
    parser.add_argument("--body-timeout-s", type=float, default=SERVER_DEFAULTS.body_timeout_s,
                        help="close a connection whose request body takes longer (default: %(default)s)")
    parser.add_argument("--max-connections", type=int, default=SERVER_DEFAULTS.max_connections,
                        help="past this many open connections, answer 503 (default: %(default)s)")
