"""The gateway's configuration: one frozen dataclass, filled from the command line or by tests."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import GatewaySettingsError
from protocol.constants import MAX_CANDIDATES, MAX_DIRECTORY_NODES
from serving.settings import MAX_BODY_BYTES, MAX_IN_FLIGHT, RETRY_AFTER_S, SERVER_DEFAULTS, check_server_settings, parse_address


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Everything `gateway.app.create_app` needs.

    `nodes` are `host:port` addresses of node gRPC services to admit at start
    and to keep re-admitting after an eviction. Bounds on in-flight requests
    make overload an immediate 503 with `Retry-After`, never a queue.
    """

    nodes: tuple[str, ...] = ()
    # DNS names (NAME:PORT) whose every address is a node, such as a Kubernetes headless Service; each
    # is resolved again every `dns_refresh_s`, and every address found is attested before admission.
    node_dns: tuple[str, ...] = ()
    dns_refresh_s: float = 30.0
    policy: str = "strict"
    listen: str = "127.0.0.1:0"
    port_file: Path | None = None
    audit: str = "none"
    allow_registration: bool = False
    # Re-attest every admitted node this often, with a fresh nonce.
    reattest_s: float = 60.0
    # Health-check admitted nodes, and retry admission of absent ones, this often.
    health_s: float = 2.0
    # After a node rotates its key, its old id keeps routing to it this long
    # (the node honours its previous key for the same grace period).
    key_grace_s: float = 300.0
    max_in_flight: int = MAX_IN_FLIGHT
    max_in_flight_per_node: int = 64
    retry_after_s: int = RETRY_AFTER_S
    max_body_bytes: int = MAX_BODY_BYTES
    max_candidates: int = MAX_CANDIDATES
    attest_timeout_s: float = 10.0
    health_timeout_s: float = 2.0
    # How long a node may take to accept a request (it does so on decapsulating it, before any work);
    # past it the answer is 504 and the request goes to no other node. The answer itself may take
    # as long as it takes: a slow answer is never a failure.
    accept_timeout_s: float = 30.0
    # How long startup waits for the configured nodes' first admission.
    startup_admission_s: float = 15.0
    # A pool larger than this is published as a uniformly random sample of this many nodes,
    # redrawn every epoch (clients accept directories of up to 4,096 nodes).
    directory_size: int = 256
    directory_epoch_s: float = 60.0
    # The serving bounds every Veil server takes (`serving.settings.ServerSettings` says what each does).
    header_timeout_s: float = SERVER_DEFAULTS.header_timeout_s
    body_timeout_s: float = SERVER_DEFAULTS.body_timeout_s
    keep_alive_s: float = SERVER_DEFAULTS.keep_alive_s
    max_connections: int = SERVER_DEFAULTS.max_connections
    # When set, only these peers (relay addresses or networks) may send requests for nodes.
    relay_only: tuple[str, ...] = ()
    # Used only when the policy's [authorization] lists issuer keys: the origin name tokens must be
    # bound to (the host[:port] clients reach this gateway by), the issuer's directory (a file or an
    # http(s) URL) holding the listed keys, and the spent-token store ("" keeps them in this process).
    origin: str = ""
    issuer_directory: str = ""
    spent_tokens: str = ""

    def __post_init__(self) -> None:
        for address in (*self.nodes, *self.node_dns):
            parse_address(address)
        _require_positive("dns_refresh_s", self.dns_refresh_s)
        check_server_settings(self)
        relay_networks(self.relay_only)
        _require_positive("reattest_s", self.reattest_s)
        _require_positive("health_s", self.health_s)
        _require_positive("attest_timeout_s", self.attest_timeout_s)
        _require_positive("health_timeout_s", self.health_timeout_s)
        _require_positive("accept_timeout_s", self.accept_timeout_s)
        _require_positive("directory_epoch_s", self.directory_epoch_s)
        if not 1 <= self.directory_size <= MAX_DIRECTORY_NODES:
            raise GatewaySettingsError(f"directory_size must be between 1 and {MAX_DIRECTORY_NODES}")
        if self.key_grace_s < 0 or self.startup_admission_s < 0:
            raise GatewaySettingsError("key_grace_s and startup_admission_s must not be negative")
        for name in ("max_in_flight", "max_in_flight_per_node", "retry_after_s", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise GatewaySettingsError(f"{name} must be at least 1")
        if not 1 <= self.max_candidates <= MAX_CANDIDATES:
            raise GatewaySettingsError(f"max_candidates must be between 1 and {MAX_CANDIDATES}")


def relay_networks(addresses: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """The relays' addresses (`127.0.0.1`, `2001:db8::7`) or networks (`10.0.0.0/24`), parsed."""
    try:
        return tuple(ipaddress.ip_network(address, strict=False) for address in addresses)
    except ValueError:
        raise GatewaySettingsError("a relay is an IP address or network (for example 127.0.0.1 or "
                                   "10.0.0.0/24), not a host name") from None


def _require_positive(name: str, value: float) -> None:
    if not value > 0:
        raise GatewaySettingsError(f"{name} must be a positive number of seconds")
