"""The token issuer on a real uvicorn server: accounts by JWT, quotas, blind issuance, directory and rotation."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from issuer.app import create_issuer_app
from issuer.errors import IssuerConfigError
from issuer.keys import add_key, load_keyring
from ohttp.privacypass import (
    TOKEN_REQUEST_MEDIA_TYPE,
    TokenChallenge,
    begin_issuance,
    decode_directory,
    finish_issuance,
    verify_token,
)
from tests.hardening_support import fuzz_settings
from tests.http_stand_in import served
from tests.issuer_support import ISSUER_NAME, eddsa_account, es256_account, issuer_config

ALICE = es256_account("alice")
BOB = eddsa_account("bob")
CHALLENGE = TokenChallenge(issuer_name="issuer.veil.test", origin_info=("gateway.veil.test",))


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("issuer-keys")
    add_key(folder, 1_000)
    add_key(folder, 2_000)
    add_key(folder, 4_000_000_000)
    return folder


def _app(key_dir: Path, tokens: int = 3, clock=time.time):  # noqa: ANN001, ANN202
    return create_issuer_app(issuer_config([ALICE, BOB], tokens_per_period=tokens), load_keyring(key_dir), clock=clock)


def _directory(url: str):  # noqa: ANN202
    answer = httpx.get(f"{url}/.well-known/private-token-issuer-directory", trust_env=False)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/private-token-issuer-directory"
    return decode_directory(answer.content)


def _request_token(url: str, token_key, credential: str | None):  # noqa: ANN001, ANN202
    pending = begin_issuance(token_key, CHALLENGE)
    headers = {"content-type": TOKEN_REQUEST_MEDIA_TYPE}
    if credential is not None:
        headers["authorization"] = f"Bearer {credential}"
    answer = httpx.post(f"{url}/token-request", content=pending.request.encode(), headers=headers, trust_env=False)
    return pending, answer


def test_an_account_obtains_a_token_that_verifies_under_the_published_key(key_dir: Path) -> None:
    with served(_app(key_dir)) as url:
        directory = _directory(url)
        current = directory.usable_keys(time.time())[0].token_key
        for account in (ALICE, BOB):
            pending, answer = _request_token(url, current, account.credential())
            assert answer.status_code == 200
            assert answer.headers["content-type"] == "application/private-token-response"
            token = finish_issuance(pending, answer.content)
            assert verify_token(token, {current.key_id: current}) == current


def test_the_directory_publishes_current_and_next_keys_only(key_dir: Path) -> None:
    ring = load_keyring(key_dir)
    with served(_app(key_dir)) as url:
        directory = _directory(url)
    assert [key.not_before for key in directory.keys] == [2_000, 4_000_000_000]
    published_ids = {key.token_key.key_id for key in directory.keys}
    assert published_ids == {dated.key.token_key.key_id for dated in ring.published(time.time())}
    assert directory.request_uri == "https://issuer.veil.test/token-request"
    # once the next key's time has come it is the current one, and the old one is gone
    assert [dated.not_before for dated in ring.published(4_000_000_001)] == [4_000_000_000]


def test_the_quota_is_enforced_per_account_and_per_period(key_dir: Path) -> None:
    now = [10_000.0]
    app = _app(key_dir, tokens=2, clock=lambda: now[0])
    with served(app) as url:
        current = _directory(url).usable_keys(now[0])[0].token_key
        codes = [_request_token(url, current, ALICE.credential())[1].status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        assert _request_token(url, current, BOB.credential())[1].status_code == 200
        now[0] += 3600
        assert _request_token(url, current, ALICE.credential())[1].status_code == 200


@pytest.mark.parametrize(
    "credential",
    [
        None,
        "not-a-jwt",
        es256_account("alice").credential(),  # the right name, another key
        es256_account("mallory").credential(),  # not registered
        ALICE.credential(audience="other-issuer.test"),
        ALICE.credential(lifetime_s=3600),
        ALICE.credential(subject="bob"),
        ALICE.credential(lifetime_s=-10),
    ],
)
def test_an_unauthenticated_request_is_refused_and_counts_nothing(key_dir: Path, credential: str | None) -> None:
    app = _app(key_dir)
    with served(app) as url:
        current = _directory(url).usable_keys(time.time())[0].token_key
        answer = _request_token(url, current, credential)[1]
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "unauthenticated"
    assert app.state.runtime.ledger.records() == {}


# RFC 7519's registered claims, and a value of the wrong type that PyJWT lets through for each (it reads
# a date with int(), so digits or `true` pass for one; it checks no type of `iss`), given the time now.
WRONGLY_TYPED: dict[str, tuple[str, Callable[[int], object]]] = {
    "iat as digits": ("iat", lambda now: str(now - 5)),
    "exp as digits": ("exp", lambda now: str(now + 60)),
    "nbf as digits": ("nbf", lambda now: str(now - 5)),
    "iat as true": ("iat", lambda now: True),
    "exp as digits with underscores": ("exp", lambda now: f"{now + 60:_}"),
    "iss as a number": ("iss", lambda now: 7),
    "iss as null": ("iss", lambda now: None),
    "sub as a list": ("sub", lambda now: ["alice"]),
    "aud holding a number": ("aud", lambda now: [ISSUER_NAME, 1]),
    "jti as an object": ("jti", lambda now: {"id": 1}),
}


def current_claims(now: int) -> dict[str, object]:
    """The claims of a current credential of alice's, every one of the right type."""
    return {"sub": "alice", "aud": ISSUER_NAME, "iat": now - 5, "exp": now + 60}


@pytest.fixture(scope="module")
def issuer_url(key_dir: Path) -> Iterator[tuple[str, object]]:
    """One issuer for many credentials, with a quota that the valid ones among them cannot reach."""
    app = _app(key_dir, tokens=1_000_000)
    with served(app) as url:
        yield url, app


def _token_request_status(url: str, credential: str) -> tuple[int, str]:
    answer = _request_token(url, _current_key(url), credential)[1]
    return answer.status_code, answer.json()["error"]["code"] if answer.status_code != 200 else ""


@functools.cache
def _current_key(url: str):  # noqa: ANN202
    return _directory(url).usable_keys(time.time())[0].token_key


def test_a_credential_with_right_types_is_served_and_counted(issuer_url) -> None:
    url, app = issuer_url
    issued_before = app.state.runtime.ledger.issued("alice")
    claims = {**current_claims(int(time.time())), "iss": "accounts.example", "nbf": 0, "jti": "j-1"}
    assert _token_request_status(url, ALICE.signed(claims)) == (200, "")
    assert app.state.runtime.ledger.issued("alice") == issued_before + 1


@pytest.mark.parametrize("case", sorted(WRONGLY_TYPED))
def test_a_registered_claim_of_the_wrong_type_is_401_and_counts_nothing(issuer_url, case: str) -> None:
    url, app = issuer_url
    claim, wrong = WRONGLY_TYPED[case]
    now = int(time.time())
    issued_before = app.state.runtime.ledger.issued("alice")
    assert _token_request_status(url, ALICE.signed({**current_claims(now), claim: wrong(now)})) == (401, "unauthenticated")
    assert app.state.runtime.ledger.issued("alice") == issued_before


def _json_values(leaves: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                              max_size=3), max_leaves=6)


_NOT_NUMBERS = _json_values(st.none() | st.booleans() | st.text(max_size=12)
                            | st.integers(-600, 600).map(lambda delta: str(int(time.time()) + delta)))
_NOT_STRINGS = _json_values(st.none() | st.booleans() | st.integers() | st.floats()).filter(
    lambda value: not isinstance(value, list) or not all(isinstance(item, str) for item in value))
_WRONG_TYPE = {"iat": _NOT_NUMBERS, "exp": _NOT_NUMBERS, "nbf": _NOT_NUMBERS, "iss": _NOT_STRINGS,
               "sub": _NOT_STRINGS, "aud": _NOT_STRINGS, "jti": _NOT_STRINGS}


@fuzz_settings()
@given(wrong=st.sampled_from(sorted(_WRONG_TYPE)).flatmap(lambda claim: st.tuples(st.just(claim), _WRONG_TYPE[claim])))
def test_any_registered_claim_of_a_wrong_type_is_401(issuer_url, wrong: tuple[str, object]) -> None:
    url, _ = issuer_url
    claim, value = wrong
    claims = {**current_claims(int(time.time())), claim: value}
    assert _token_request_status(url, ALICE.signed(claims)) == (401, "unauthenticated")


_ANY_JSON = _json_values(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
                        | st.integers(-900, 900).map(lambda delta: int(time.time()) + delta))


def _right_type(claim: str, value: object) -> bool:
    if claim in ("iat", "exp", "nbf"):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str) or (claim == "aud" and isinstance(value, list)
                                      and all(isinstance(item, str) for item in value))


@fuzz_settings()
@given(claim=st.sampled_from(sorted(_WRONG_TYPE)), value=_ANY_JSON)
def test_any_value_of_a_registered_claim_is_served_or_401_and_only_of_its_type_served(issuer_url, claim: str,
                                                                                      value: object) -> None:
    url, _ = issuer_url
    status, code = _token_request_status(url, ALICE.signed({**current_claims(int(time.time())), claim: value}))
    assert (status, code) in ((200, ""), (401, "unauthenticated"))
    assert status == 401 or _right_type(claim, value)


def test_a_bad_token_request_is_refused_and_not_counted(key_dir: Path) -> None:
    app = _app(key_dir)
    with served(app) as url:
        current = _directory(url).usable_keys(time.time())[0].token_key
        pending = begin_issuance(current, CHALLENGE)
        headers = {"authorization": f"Bearer {ALICE.credential()}", "content-type": TOKEN_REQUEST_MEDIA_TYPE}
        unknown_key = bytearray(pending.request.encode())
        unknown_key[2] ^= 0xFF
        for body in (b"", pending.request.encode()[:-1], bytes(unknown_key), b"\x00\x01" + b"\x00" * 257):
            answer = httpx.post(f"{url}/token-request", content=body, headers=headers, trust_env=False)
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "bad_token_request"
        wrong_type = {**headers, "content-type": "application/octet-stream"}
        answer = httpx.post(f"{url}/token-request", content=pending.request.encode(), headers=wrong_type, trust_env=False)
        assert answer.status_code == 415
    assert app.state.runtime.ledger.issued("alice") == 0


def test_the_issuer_keeps_counters_only(key_dir: Path) -> None:
    """After issuing, the issuer's state holds per-account counts and none of the request's bytes."""
    app = _app(key_dir)
    with served(app) as url:
        current = _directory(url).usable_keys(time.time())[0].token_key
        pending, answer = _request_token(url, current, ALICE.credential())
        token = finish_issuance(pending, answer.content)
    records = app.state.runtime.ledger.records()
    assert list(records) == ["alice"] and records["alice"][1] == 1
    state = repr(app.state.runtime.ledger.__dict__) + repr(vars(app.state))
    for secret in (token.nonce, pending.request.blinded_msg[:16], answer.content[:16]):
        assert secret.hex() not in state and repr(secret) not in state


def test_keys_sharing_a_truncated_id_or_a_missing_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(IssuerConfigError):
        load_keyring(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(IssuerConfigError):
        load_keyring(tmp_path / "empty")
    first = add_key(tmp_path / "ring", 5)
    second = add_key(tmp_path / "ring", 6)
    assert first.token_key.truncated_key_id != second.token_key.truncated_key_id
    with pytest.raises(IssuerConfigError):
        add_key(tmp_path / "ring", 5)
    assert oct((tmp_path / "ring" / "token-key-5.pem").stat().st_mode & 0o777) == "0o600"
