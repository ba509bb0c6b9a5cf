"""Privacy Pass end to end on loopback: an issuer, a gateway demanding tokens and a real node process.

The client obtains tokens blindly from the issuer and is served; a replayed token is refused with 401
before anything reaches a node; the issuer's records hold per-account counts and no token nonce.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from attestation.sim_root import ROOT_DIR_ENV
from client.errors import GatewayError
from client.sdk import Client
from client.tokens import TokenWallet
from engine.tiny import write_tiny_model
from issuer.app import create_issuer_app
from issuer.keys import add_key, load_keyring
from ohttp.privacypass import parse_authorization
from tests.http_stand_in import served
from tests.issuer_support import es256_account, issuer_config
from tests.token_support import policy_listing
from veil.fleet import Fleet, FleetSettings

pytestmark = pytest.mark.slow
MODEL = "tiny-model"
ORIGIN = "gateway.veil.test"
ALICE = es256_account("alice")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str, object, list]]:
    root = tmp_path_factory.mktemp("e2e-tokens")
    # The current key, listed by the policy; and the next one, published but not listed yet.
    keys = [add_key(root / "issuer-keys", 1_000), add_key(root / "issuer-keys", 4_000_000_000)]
    policy = policy_listing(root / "policy.toml", keys[:1])
    issuer = create_issuer_app(issuer_config([ALICE], tokens_per_period=6), load_keyring(root / "issuer-keys"))
    with served(issuer) as issuer_url:
        settings = FleetSettings(
            nodes=1, model_dir=write_tiny_model(root / MODEL), workdir=root / "fleet", torch_threads=1,
            policy=str(policy), extra_gateway_args=(
                "--origin", ORIGIN, "--issuer-directory", f"{issuer_url}/.well-known/private-token-issuer-directory",
                "--spent-tokens", f"sqlite:{root / 'spent.sqlite'}"),
        )
        previous = os.environ.get(ROOT_DIR_ENV)
        with Fleet(settings) as fleet:
            os.environ[ROOT_DIR_ENV] = str(fleet.sim_root_dir)
            try:
                yield fleet, issuer_url, issuer, keys
            finally:
                if previous is None:
                    os.environ.pop(ROOT_DIR_ENV, None)
                else:
                    os.environ[ROOT_DIR_ENV] = previous


class RecordingWallet(TokenWallet):
    """A real wallet that remembers the Authorization values it handed out, to replay one."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.handed_out: list[str] = []

    def authorization(self) -> str:
        value = super().authorization()
        self.handed_out.append(value)
        return value


def test_a_client_with_tokens_is_served_and_a_replayed_token_refused(stack) -> None:
    fleet, issuer_url, issuer, _ = stack
    # Refilled once empty (refill_at=0), so that three requests take exactly two batches.
    wallet = RecordingWallet(issuer_url, ALICE.credential, policy=str(fleet.settings.policy), origin=ORIGIN,
                             batch_size=2, refill_at=0)
    with Client(fleet.gateway_url, policy=str(fleet.settings.policy), tokens=wallet) as client:
        for attempt in range(3):
            answer = client.completions.create(model=MODEL, prompt=f"hello {attempt}", max_tokens=3)
            assert answer.choices[0].finish_reason in ("length", "stop")
    assert len(set(wallet.handed_out)) == len(wallet.handed_out) == 3  # one fresh token per request

    replayed = httpx.post(f"{fleet.gateway_url}/v1/infer", json={"candidates": []},
                          headers={"authorization": wallet.handed_out[0]}, trust_env=False)
    assert replayed.status_code == 401 and replayed.json()["error"]["code"] == "token_required"
    assert "PrivateToken challenge=" in replayed.headers["www-authenticate"]

    # The issuer counted alice's tokens and holds nothing else: no nonce of any token it signed.
    records = issuer.state.runtime.ledger.records()
    assert list(records) == ["alice"] and records["alice"][1] == 4  # two batches of two
    state = repr(issuer.state.runtime.ledger.__dict__)
    for value in wallet.handed_out:
        assert parse_authorization(value).nonce.hex() not in state


def test_without_a_token_the_client_is_refused_before_any_node(stack) -> None:
    fleet, *_ = stack
    with Client(fleet.gateway_url, policy=str(fleet.settings.policy)) as client:
        with pytest.raises(GatewayError) as refused:
            client.completions.create(model=MODEL, prompt="no token", max_tokens=2)
    assert refused.value.status == 401

