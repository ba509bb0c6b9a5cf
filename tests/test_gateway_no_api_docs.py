"""No HTTP server of Veil serves API documentation: neither /docs nor /redoc nor /openapi.json.

FastAPI's /docs and /redoc pages load their scripts and styles from a public CDN, so whoever opened
one would tell a third party which Veil server they look at; and a schema without its page is half a
feature. The gateway, the relay, the token issuer and the local proxy therefore serve neither; their
routes are described in the README. Real servers on loopback.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from client.proxy import create_proxy_app
from client.sdk import Client
from issuer.app import create_issuer_app
from issuer.keys import add_key, load_keyring
from relay.app import RelaySettings, create_relay_app
from tests.issuer_support import es256_account, issuer_config
from tests.test_gateway_support import LiveGateway, LiveServer, gateway_settings, sim_root  # noqa: F401

DOC_PATHS = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")


@pytest.fixture(scope="module")
def servers(sim_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    settings = gateway_settings([])
    keys = tmp_path_factory.mktemp("issuer-keys")
    add_key(keys, int(time.time()))
    relay_settings = RelaySettings(gateway_url="http://127.0.0.1:1")
    with LiveGateway(settings) as gateway, Client(gateway.url, policy="dev") as sdk, \
            LiveServer(create_relay_app(relay_settings), relay_settings.serving()) as relay, \
            LiveServer(create_issuer_app(issuer_config([es256_account("alice")]), load_keyring(keys)),
                       settings) as issuer, \
            LiveServer(create_proxy_app(sdk), settings) as proxy:
        yield {"gateway": gateway.url, "relay": relay.url, "issuer": issuer.url, "proxy": proxy.url}


@pytest.mark.parametrize("server", ["gateway", "relay", "issuer", "proxy"])
@pytest.mark.parametrize("path", DOC_PATHS)
def test_no_server_serves_api_documentation(servers: dict[str, str], server: str, path: str) -> None:
    answer = httpx.get(servers[server] + path, timeout=30, trust_env=False)
    assert answer.status_code == 404
    assert "swagger" not in answer.text.lower() and '"openapi"' not in answer.text


def test_the_servers_do_answer_on_their_own_routes(servers: dict[str, str]) -> None:
    """The 404s above come from live servers, not from nothing listening."""
    assert httpx.get(servers["gateway"] + "/v1/health", timeout=30, trust_env=False).json()["status"] == "ok"
    assert httpx.get(servers["issuer"] + "/.well-known/private-token-issuer-directory", timeout=30,
                     trust_env=False).status_code == 200
