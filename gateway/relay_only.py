"""Accepting inference only from the gateway's own relays (`veil gateway --relay-only ADDRESS`).

A gateway behind relays should never see a client connect directly: a client
that does (by mistake, or tricked by an operator who wants its address) gives
its address away with its ciphertext. With relay addresses configured, the
routes that carry a request for a node (`/v1/infer`, `/v1/nodes/{id}/ohttp`,
`/v1/nodes/{id}/attest`) answer 403 to any other peer before reading a byte of
the body. The check reads the TCP peer address only (uvicorn runs with
`proxy_headers` off, so no header can claim another) and neither logs nor
keeps it. The directory and health stay open to everyone: they are the same
for every caller.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable

# At run time, not only for type checkers: FastAPI reads the dependency's annotation to pass the request.
from fastapi import Request

from gateway.errors import RelayOnlyError
from gateway.settings import relay_networks

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_NOT_A_RELAY = "this gateway accepts requests for nodes only through its relays; send the request through one"


def only_from_relays(addresses: tuple[str, ...]) -> Callable[[Request], Awaitable[None]]:
    """A route dependency that refuses (403) every peer outside `addresses`; it admits all if there are none."""
    networks = relay_networks(addresses)

    async def from_a_relay(request: Request) -> None:
        if networks and not _peer_in(request, networks):
            raise RelayOnlyError(_NOT_A_RELAY)

    return from_a_relay


def _peer_in(request: Request, networks: tuple[Network, ...]) -> bool:
    if request.client is None:
        return False
    try:
        peer = ipaddress.ip_address(request.client.host)
    except ValueError:
        return False
    if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
        peer = peer.ipv4_mapped  # a dual-stack listener reports IPv4 peers as ::ffff:a.b.c.d
    return any(peer in network for network in networks)
