"""Node discovery by DNS: every address a name resolves to is a node (a Kubernetes headless Service).

The keeper asks `NodeDiscovery.due_addresses` at the start of each upkeep round; every
`refresh_s` it resolves each `NAME:PORT` again (off the event loop) and answers the addresses
found, which the keeper then treats as it treats `--node` addresses: each is health-checked and
attested over a fresh nonce before admission, and one that is no longer listed is evicted and
forgotten. A name that fails to resolve keeps its last addresses (a DNS hiccup evicts nobody) and
is logged once, by name, until it resolves again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

from gateway.settings import parse_address

_log = logging.getLogger("veil.gateway")

# host, port -> the node addresses ("HOST:PORT", "[V6]:PORT") it resolves to.
Resolver = Callable[[str, int], list[str]]


def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as node addresses on `port` (raises OSError when it does not resolve)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({node_address(info[4][0], port) for info in infos})


def node_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class NodeDiscovery:
    """The addresses of the `NAME:PORT` names, resolved again every `refresh_s`."""

    def __init__(self, names: tuple[str, ...], refresh_s: float, resolver: Resolver = resolve_addresses,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._names = tuple(parse_address(name) for name in names)
        self._refresh_s = refresh_s
        self._resolver = resolver
        self._clock = clock
        self._next = clock()
        self._last: dict[tuple[str, int], set[str]] = {}
        self._failing: set[tuple[str, int]] = set()

    async def due_addresses(self) -> set[str] | None:
        """Every address found now, when a refresh is due; None when it is not (or there is no name)."""
        if not self._names or self._clock() < self._next:
            return None
        self._next = self._clock() + self._refresh_s
        for name in self._names:
            await self._resolve(name)
        return set().union(*self._last.values()) if self._last else set()

    async def _resolve(self, name: tuple[str, int]) -> None:
        try:
            found = await asyncio.to_thread(self._resolver, *name)
        except OSError:
            if name not in self._failing:
                self._failing.add(name)
                _log.warning("veil gateway: %s:%s does not resolve; keeping its last addresses", *name)
            return
        self._failing.discard(name)
        self._last[name] = set(found)
