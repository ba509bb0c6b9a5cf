"""The SDK's token wallet against a real issuer on loopback: bound to the issuer keys its policy lists.

An issuer that gave one account a key of its own would recognise that account's requests by the key
their tokens verify under; the policy lists the keys every client may use, so a wallet takes and spends
tokens only under those, and a `Client` accepts only a wallet bound to its own policy.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from client.errors import TokenIssuanceError, TokenPolicyError
from client.sdk import Client
from client.tokens import TokenWallet
from issuer.app import create_issuer_app
from issuer.keys import add_key, load_keyring
from ohttp.privacypass import IssuerKey, parse_authorization
from tests.http_stand_in import served
from tests.issuer_support import es256_account, issuer_config
from tests.token_support import policy_listing

ORIGIN = "gateway.veil.test"
ALICE = es256_account("alice")
UNUSED_GATEWAY = "http://127.0.0.1:9"  # a Client that refuses its wallet never connects


@dataclass(frozen=True)
class Issuer:
    url: str
    app: object
    current: IssuerKey  # published and in use
    upcoming: IssuerKey  # published, its not-before still ahead

    def counted(self) -> dict[str, tuple[int, int]]:
        return self.app.state.runtime.ledger.records()


@pytest.fixture(scope="module")
def issuer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Issuer]:
    folder = tmp_path_factory.mktemp("issuer-keys")
    current, upcoming = add_key(folder, 1_000), add_key(folder, 4_000_000_000)
    app = create_issuer_app(issuer_config([ALICE], tokens_per_period=100), load_keyring(folder))
    with served(app) as url:
        yield Issuer(url, app, current, upcoming)


def wallet(issuer: Issuer, policy: str | Path, batch_size: int = 2) -> TokenWallet:
    return TokenWallet(issuer.url, ALICE.credential, policy=str(policy), origin=ORIGIN, batch_size=batch_size)


def test_the_wallet_takes_and_spends_tokens_only_under_a_key_its_policy_lists(issuer: Issuer, tmp_path: Path) -> None:
    listed = wallet(issuer, policy_listing(tmp_path / "policy.toml", [issuer.current]))
    spent = [parse_authorization(listed.authorization()) for _ in range(3)]
    assert {token.token_key_id for token in spent} == {issuer.current.token_key.key_id}
    assert len({token.nonce for token in spent}) == 3


def test_the_wallet_fetches_nothing_from_an_issuer_publishing_no_listed_key(issuer: Issuer, tmp_path: Path) -> None:
    """The issuer's current key is not the listed one, as if it had given this account a key of its own."""
    own_key = add_key(tmp_path / "elsewhere", 1_000)  # a key the issuer does not publish
    unlisted = wallet(issuer, policy_listing(tmp_path / "policy.toml", [own_key]))
    counted_before = issuer.counted()
    with pytest.raises(TokenIssuanceError, match="no current key that the policy lists"):
        unlisted.authorization()
    assert issuer.counted() == counted_before, "a token was requested under a key the policy does not list"


def test_a_policy_listing_no_issuer_key_gets_no_wallet(issuer: Issuer) -> None:
    with pytest.raises(TokenPolicyError, match="lists no issuer key"):
        wallet(issuer, "dev")


def test_the_client_refuses_a_wallet_bound_to_keys_its_policy_does_not_list(issuer: Issuer, tmp_path: Path) -> None:
    client_policy = policy_listing(tmp_path / "client.toml", [issuer.current])
    others = [[issuer.upcoming], [issuer.current, issuer.upcoming]]
    wallets = [wallet(issuer, policy_listing(tmp_path / f"other-{index}.toml", keys)) for index, keys in enumerate(others)]
    wallets.append(wallet(issuer, policy_listing(tmp_path / "other-issuer.toml", [issuer.current], "other.veil.test")))
    counted_before = issuer.counted()
    for other in wallets:
        with pytest.raises(TokenPolicyError, match="bound to other issuer keys"):
            Client(UNUSED_GATEWAY, policy=str(client_policy), tokens=other)
        with pytest.raises(TokenPolicyError):
            Client(UNUSED_GATEWAY, policy="dev", tokens=other)
    assert issuer.counted() == counted_before
    with Client(UNUSED_GATEWAY, policy=str(client_policy), tokens=wallet(issuer, client_policy)) as accepted:
        assert accepted.policy.authorization.issuer_keys == (issuer.current.token_key.key_id.hex(),)


class ParkingIssuer:
    """The real issuer behind a gate: while `open` is clear, each token request waits in it (`parked` is set)."""

    def __init__(self, app: object) -> None:
        self.app = app
        self.open, self.parked = threading.Event(), threading.Event()
        self.open.set()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] == "http" and scope["method"] == "POST" and not self.open.is_set():
            self.parked.set()
            await asyncio.to_thread(self.open.wait, 300)
        await self.app(scope, receive, send)


def test_a_thread_takes_a_token_while_a_refill_waits_on_the_issuer(tmp_path: Path) -> None:
    key = add_key(tmp_path / "keys", 1_000)
    issuer = ParkingIssuer(create_issuer_app(issuer_config([ALICE], tokens_per_period=100),
                                             load_keyring(tmp_path / "keys")))
    with served(issuer) as url:
        tokens = TokenWallet(url, ALICE.credential, policy=str(policy_listing(tmp_path / "policy.toml", [key])),
                             origin=ORIGIN, batch_size=4, refill_at=1)
        taken = [tokens.authorization()]  # the first batch: three left
        issuer.open.clear()  # from now on a refill waits in the issuer until released
        taken += [tokens.authorization(), tokens.authorization()]  # one left: the refill starts ahead of need
        assert issuer.parked.wait(300), "no refill started ahead of need"
        with ThreadPoolExecutor(1) as other:  # another thread, while that refill is parked in the issuer
            taken.append(other.submit(tokens.authorization).result(timeout=300))
        assert not issuer.open.is_set()  # it was served by the batch in hand, not by the parked refill
        issuer.open.set()
        taken.append(tokens.authorization())  # from the refilled batch
        tokens.close()
    assert len({parse_authorization(value).nonce for value in taken}) == 5


def test_a_token_given_back_is_the_next_one_handed_out(issuer: Issuer, tmp_path: Path) -> None:
    tokens = wallet(issuer, policy_listing(tmp_path / "policy.toml", [issuer.current]), batch_size=3)
    first = tokens.authorization()
    tokens.give_back(first)
    assert tokens.authorization() == first
    assert tokens.authorization() != first
