"""The whole anonymous path on loopback, as `veil demo` runs it: client -> relay -> gateway -> node, with tokens.

Real processes started by the fleet: an issuer, a relay, a gateway demanding tokens and taking requests for
nodes from the relay's address only, and a tiny node. A recording TCP proxy between the relay and the gateway
keeps every byte and peer address the gateway receives; the client, bound to 127.0.0.3, records what it sends
the relay. Neither holds the client's address, a client header or the account's name, and the issuer keeps
no token nonce anywhere it writes.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from attestation.sim_root import ROOT_DIR_ENV
from client.sdk import Client
from client.tokens import TokenWallet
from engine.tiny import write_tiny_model
from ohttp.privacypass import parse_authorization
from veil.fleet import Fleet, FleetSettings

pytestmark = pytest.mark.slow
CLIENT_ADDRESS = "127.0.0.3"
ACCOUNT = "canary-account-5e1f9a"
CANARY = "canary-7f3e-client-identity"
IDENTIFYING_HEADERS = {"user-agent": f"browser {CANARY}", "cookie": f"session={CANARY}",
                       "x-forwarded-for": "203.0.113.9", "accept-language": "fr-CH"}
RELAY_SET_HEADERS = {"host", "content-length", "content-type", "authorization"}


@dataclass
class RecordingProxy:
    """Forwards TCP connections to `upstream_port` on loopback, keeping each peer address and every byte sent up."""

    upstream_port: int | None = None
    peers: list[str] = field(default_factory=list)
    received: list[bytearray] = field(default_factory=list)
    _listener: socket.socket = field(init=False)

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                downstream, (peer, _) = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.peers.append(peer)
            self.received.append(record := bytearray())
            threading.Thread(target=_pump, args=(downstream, upstream, record), daemon=True).start()
            threading.Thread(target=_pump, args=(upstream, downstream, None), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket, record: bytearray | None) -> None:
    try:
        while data := source.recv(65536):
            if record is not None:
                record.extend(data)
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def request_heads(stream: bytes) -> list[tuple[str, dict[str, str]]]:
    """Each HTTP/1.1 request's line and headers in one connection's bytes (bodies framed by content-length)."""
    heads = []
    while stream:
        head, separator, rest = stream.partition(b"\r\n\r\n")
        assert separator, "a request head was cut off"
        line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
        assert "transfer-encoding" not in headers, "this parser frames bodies by content-length only"
        length = int(headers.get("content-length", "0"))
        heads.append((line, headers))
        stream = rest[length:]
    return heads


class RecordingWallet(TokenWallet):
    """A real wallet that remembers the Authorization values it handed out."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.handed_out: list[str] = []

    def authorization(self) -> str:
        self.handed_out.append(value := super().authorization())
        return value


@dataclass
class AnonymousPath:
    fleet: Fleet
    proxy: RecordingProxy
    sent_to_relay: list[httpx.Request]
    wallet: RecordingWallet
    answers: list[str]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AnonymousPath]:
    root = tmp_path_factory.mktemp("anonymous-path")
    proxy = RecordingProxy()
    settings = FleetSettings(nodes=1, model_dir=write_tiny_model(root / "tiny-model"), workdir=root / "fleet",
                             torch_threads=1, tokens=True, relay=True, account=ACCOUNT, relay_target=proxy.url)
    previous = os.environ.get(ROOT_DIR_ENV)
    try:
        with Fleet(settings) as fleet:
            proxy.upstream_port = fleet.gateway.port
            os.environ[ROOT_DIR_ENV] = str(fleet.sim_root_dir)
            sent: list[httpx.Request] = []
            http = httpx.Client(base_url=fleet.client_url, timeout=60.0, trust_env=False, headers=IDENTIFYING_HEADERS,
                                transport=httpx.HTTPTransport(local_address=CLIENT_ADDRESS),
                                event_hooks={"request": [sent.append]})
            wallet = fleet.token_wallet(batch_size=3, kind=RecordingWallet)
            with Client(fleet.client_url, policy=fleet.policy, tokens=wallet, http=http) as client:
                answers = [client.completions.create(model="tiny-model", prompt="hello", max_tokens=3).choices[0].text]
                with client.chat.completions.create(model="tiny-model", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3, stream=True) as stream:
                    answers.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
                yield AnonymousPath(fleet, proxy, sent, wallet, answers)
    finally:
        proxy.close()
        if previous is None:
            os.environ.pop(ROOT_DIR_ENV, None)
        else:
            os.environ[ROOT_DIR_ENV] = previous


def test_requests_through_the_relay_with_one_token_each_are_served(path: AnonymousPath) -> None:
    assert len(path.answers) == 2
    assert len(path.wallet.handed_out) == len(set(path.wallet.handed_out)) == 2
    infers = [request for request in path.sent_to_relay if request.url.path == "/v1/infer"]
    assert [request.headers["authorization"] for request in infers] == path.wallet.handed_out
    assert all(str(request.url).startswith(path.fleet.relay_url) for request in path.sent_to_relay)


def test_the_gateway_receives_no_client_address_header_or_account_only_the_relays(path: AnonymousPath) -> None:
    assert path.proxy.peers and set(path.proxy.peers) == {"127.0.0.1"}, "the gateway saw another peer than the relay"
    everything = b"".join(path.proxy.received)
    for secret in (CLIENT_ADDRESS, CANARY, "203.0.113.9", "fr-CH", ACCOUNT):
        assert secret.encode() not in everything
    heads = [head for stream in path.proxy.received for head in request_heads(bytes(stream))]
    assert any(line.startswith("POST /v1/infer ") for line, _ in heads)
    for line, headers in heads:
        assert set(headers) <= RELAY_SET_HEADERS, f"{line}: the gateway got {set(headers) - RELAY_SET_HEADERS}"
        assert headers.get("authorization", "PrivateToken ").startswith("PrivateToken ")
    tokens_at_gateway = [headers["authorization"] for line, headers in heads if "authorization" in headers]
    assert tokens_at_gateway == path.wallet.handed_out


def test_the_relay_receives_tokens_but_never_the_account(path: AnonymousPath) -> None:
    for request in path.sent_to_relay:
        assert ACCOUNT.encode() not in request.content and ACCOUNT not in repr(request.headers.raw)
        assert "bearer" not in request.headers.get("authorization", "").lower()


def test_no_audit_file_process_output_or_store_names_the_account_or_the_client(path: AnonymousPath) -> None:
    issuer_config = path.fleet.workdir / "issuer" / "issuer.toml"  # where the account is registered, on purpose
    written = [file for file in path.fleet.workdir.rglob("*") if file.is_file() and file != issuer_config]
    assert path.fleet.audit_files() and len(path.fleet.log_files()) == 2 * 4  # node, gateway, issuer, relay
    assert any(file.name.startswith("spent-tokens") for file in written)
    for file in written:
        content = file.read_bytes()
        assert ACCOUNT.encode() not in content, f"{file.name} names the account"
        assert CLIENT_ADDRESS.encode() not in content and CANARY.encode() not in content, f"{file.name}"


def test_the_issuer_keeps_no_token_nonce_in_anything_it_writes(path: AnonymousPath) -> None:
    issuer_files = [path.fleet.issuer.stdout_path, path.fleet.issuer.stderr_path,
                    *(file for file in (path.fleet.workdir / "issuer").rglob("*") if file.is_file())]
    nonces = [parse_authorization(value).nonce for value in path.wallet.handed_out]
    for file in issuer_files:
        content = file.read_bytes()
        for nonce in nonces:
            assert nonce not in content and nonce.hex().encode() not in content, f"{file.name} holds a nonce"


def test_a_replayed_token_through_the_relay_is_401_and_a_direct_request_403(path: AnonymousPath) -> None:
    transport = httpx.HTTPTransport(local_address=CLIENT_ADDRESS)
    with httpx.Client(base_url=path.fleet.relay_url, trust_env=False, transport=transport) as through_relay:
        replayed = through_relay.post("/v1/infer", json={"candidates": []},
                                      headers={"authorization": path.wallet.handed_out[0]})
    assert replayed.status_code == 401 and replayed.json()["error"]["code"] == "token_required"
    direct_transport = httpx.HTTPTransport(local_address=CLIENT_ADDRESS)
    with httpx.Client(base_url=path.fleet.gateway_url, trust_env=False, transport=direct_transport) as direct:
        refused = direct.post("/v1/infer", json={"candidates": []}, headers={"authorization": path.wallet.handed_out[1]})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "relay_only"
