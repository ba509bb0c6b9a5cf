"""The gateway follows a DNS name's addresses: each found node is attested before admission, a vanished one evicted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from audit.events import NodeEvicted
from audit.sink import MemorySink
from gateway.app import create_app
from tests.test_gateway_support import (  # noqa: F401  (sim_root is a fixture)
    GrpcNode,
    LiveServer,
    SimEvidence,
    gateway_settings,
    recording_nodes,
    sim_root,
)
from tests.conftest import HANG_S

NAME = "veil-node.veil-nodes.svc.cluster.local:7001"


class Answers:
    """A resolver whose answer the test sets (as a cluster's DNS would change), recording what it was asked."""

    def __init__(self) -> None:
        self.addresses: list[str] | OSError = []
        self.asked: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if isinstance(self.addresses, OSError):
            raise self.addresses
        return list(self.addresses)


class DiscoveringGateway(LiveServer):
    def __init__(self, resolver, static: list[str] | None = None, **overrides) -> None:
        self.audit = MemorySink()
        settings = gateway_settings(static or [], **overrides)
        super().__init__(create_app(settings, audit_sink=self.audit, node_resolver=resolver), settings)
        self.runtime = self.app.state.runtime

    def run_round(self) -> None:
        import asyncio

        loop = self.runtime.keeper._task.get_loop()
        asyncio.run_coroutine_threadsafe(self.runtime.keeper.run_round(), loop).result(HANG_S)

    def admitted(self) -> set[str]:
        return {entry.address for entry in self.runtime.pool.entries()}


@pytest.fixture(scope="module")
def nodes(sim_root: Path) -> Iterator[list[GrpcNode]]:
    # The third's debug-mode evidence answers, but its attestation fails, so it is never admitted.
    with recording_nodes([SimEvidence(), SimEvidence(), SimEvidence(debug=True)]) as started:
        yield started


def test_the_gateway_admits_what_the_name_resolves_to_and_follows_its_changes(nodes: list[GrpcNode]) -> None:
    first, second, debug = nodes
    answers = Answers()
    answers.addresses = [first.address]
    with DiscoveringGateway(answers, node_dns=(NAME,), dns_refresh_s=0.001) as gateway:
        assert gateway.admitted() == {first.address}
        assert answers.asked[0] == ("veil-node.veil-nodes.svc.cluster.local", 7001)

        answers.addresses = [first.address, second.address, debug.address]
        gateway.run_round()
        assert gateway.admitted() == {first.address, second.address}  # the debug node failed attestation
        assert debug.servicer.nonces  # it was challenged like any other

        answers.addresses = [second.address]
        gateway.run_round()
        assert gateway.admitted() == {second.address}
        evicted = [event for event in gateway.audit.events if isinstance(event, NodeEvicted)]
        assert [event.reason.value for event in evicted] == ["drained"]

        answers.addresses = OSError("no such name")  # a DNS failure evicts nobody
        gateway.run_round()
        assert gateway.admitted() == {second.address}


def test_static_nodes_stay_when_the_name_stops_listing_them(nodes: list[GrpcNode]) -> None:
    first, second, _ = nodes
    answers = Answers()
    answers.addresses = [first.address, second.address]
    with DiscoveringGateway(answers, [first.address], node_dns=(NAME,), dns_refresh_s=0.001) as gateway:
        assert gateway.admitted() == {first.address, second.address}
        answers.addresses = []
        gateway.run_round()
        assert gateway.admitted() == {first.address}


def test_the_system_resolver_follows_localhost(nodes: list[GrpcNode]) -> None:
    from gateway.discovery import resolve_addresses

    first = nodes[0]
    with DiscoveringGateway(resolve_addresses, node_dns=(f"localhost:{first.port}",)) as gateway:
        assert first.address in gateway.admitted()


def test_a_name_must_be_name_colon_port() -> None:
    from serving.errors import SettingsError

    with pytest.raises(SettingsError):
        gateway_settings([], node_dns=("no-port",))
