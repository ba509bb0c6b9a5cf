"""Token type 2 beyond the vectors: round trips, every bit flip refused, strict bounded header parsing."""

from __future__ import annotations

import functools

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from ohttp.privacypass import (
    ChallengeMismatchError,
    InvalidSignatureError,
    IssuerDirectory,
    DirectoryKey,
    MalformedError,
    PrivacyPassError,
    TokenChallenge,
    UnknownTokenKeyError,
    UnsupportedTokenTypeError,
    answer_token_request,
    begin_issuance,
    decode_directory,
    decode_token,
    decode_token_challenge,
    encode_authorization,
    encode_directory,
    encode_www_authenticate,
    finish_issuance,
    issuer_key,
    parse_authorization,
    parse_www_authenticate,
    require_challenge,
    verify_token,
)
from ohttp.privacypass import blind_rsa
from ohttp.privacypass.encoding import b64url_encode

CHALLENGE = TokenChallenge(issuer_name="issuer.veil.test", origin_info=("gateway.veil.test",))


@functools.cache
def _key(seed: int = 0):  # noqa: ANN202 - a cached IssuerKey per seed
    return issuer_key(rsa.generate_private_key(public_exponent=65537, key_size=2048))


def _issue(challenge: TokenChallenge = CHALLENGE):  # noqa: ANN202
    key = _key()
    pending = begin_issuance(key.token_key, challenge)
    return finish_issuance(pending, answer_token_request([key], pending.request.encode()))


def _trusted() -> dict:
    return {_key().token_key.key_id: _key().token_key}


def test_an_issued_token_verifies_and_is_bound_to_its_challenge() -> None:
    token = _issue()
    assert verify_token(token, _trusted()) == _key().token_key
    require_challenge(token, CHALLENGE.digest())
    other = TokenChallenge(issuer_name="issuer.veil.test", origin_info=("elsewhere.test",))
    with pytest.raises(ChallengeMismatchError):
        require_challenge(token, other.digest())


def test_every_single_bit_flip_of_a_token_is_refused() -> None:
    encoded = _issue().encode()
    trusted = _trusted()
    for bit in range(len(encoded) * 8):
        flipped = bytearray(encoded)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(PrivacyPassError):
            token = decode_token(bytes(flipped))
            verify_token(token, trusted)
            require_challenge(token, CHALLENGE.digest())


def test_a_token_under_an_untrusted_key_is_refused() -> None:
    with pytest.raises(UnknownTokenKeyError):
        verify_token(_issue(), {})


def test_a_wrong_blind_signature_is_refused_before_unblinding() -> None:
    key = _key()
    pending = begin_issuance(key.token_key, CHALLENGE)
    other = begin_issuance(key.token_key, CHALLENGE)
    with pytest.raises(InvalidSignatureError):
        finish_issuance(pending, answer_token_request([key], other.request.encode()))


def test_a_request_for_an_unknown_key_is_refused() -> None:
    key = _key()
    request = bytearray(begin_issuance(key.token_key, CHALLENGE).request.encode())
    request[2] ^= 0xFF
    with pytest.raises(UnknownTokenKeyError):
        answer_token_request([key], bytes(request))


def test_blind_sign_refuses_a_message_not_below_the_modulus() -> None:
    with pytest.raises(MalformedError):
        blind_rsa.blind_sign(_key().private_key, b"\xff" * 256)


@settings(max_examples=5, deadline=None)
@given(msg=st.binary(max_size=200), variant=st.sampled_from(blind_rsa.VARIANTS))
def test_blind_rsa_round_trip_for_any_message(msg: bytes, variant: blind_rsa.Variant) -> None:
    key = _key()
    public = key.private_key.public_key()
    prepared = blind_rsa.prepare(variant, msg)
    blinding = blind_rsa.blind(public, variant, prepared)
    signature = blind_rsa.finalize(public, variant, prepared, blind_rsa.blind_sign(key.private_key, blinding.blinded_msg), blinding)
    blind_rsa.verify(public, variant, prepared, signature)
    with pytest.raises(InvalidSignatureError):
        blind_rsa.verify(public, variant, prepared + b"x", signature)


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-:", min_size=1, max_size=40)


@settings(max_examples=50, deadline=None)
@given(
    issuer=_names,
    origins=st.lists(_names, max_size=4).map(tuple),
    context=st.sampled_from([b"", bytes(32), bytes(range(32))]),
)
def test_token_challenge_round_trip(issuer: str, origins: tuple[str, ...], context: bytes) -> None:
    challenge = TokenChallenge(issuer_name=issuer, origin_info=origins, redemption_context=context)
    assert decode_token_challenge(challenge.encode()) == challenge
    [parsed] = parse_www_authenticate(encode_www_authenticate(challenge, [_key().token_key], max_age=60))
    assert parsed.challenge == challenge and parsed.challenge_bytes == challenge.encode()
    assert parsed.token_key.key_id == _key().token_key.key_id and parsed.max_age == 60


def test_authorization_round_trip_and_unpadded_base64url() -> None:
    token = _issue()
    assert parse_authorization(encode_authorization(token)) == token
    unpadded = "PrivateToken token=" + b64url_encode(token.encode()).rstrip("=")
    assert parse_authorization(unpadded) == token


@pytest.mark.parametrize(
    "value",
    [
        "",
        "Bearer abc",
        "PrivateToken",
        'PrivateToken token="!!!"',
        'PrivateToken token="AAIA"',
        'PrivateToken token="a+b/"',
        'PrivateToken token="AA==", token="AA=="',
        'PrivateToken token="AA==" extra="1"',
        'PrivateToken token="\\AA=="',
        'PrivateToken token="' + "A" * 9000 + '"',
        'PrivateToken token="AA==", PrivateToken token="AA=="',
        'PrivateToken token="AA==", nonce="AA=="',
        "PrivateToken token=AB==",
    ],
)
def test_malformed_authorization_is_refused_with_the_package_error(value: str) -> None:
    with pytest.raises(MalformedError) as refused:
        parse_authorization(value)
    assert "AA==" not in str(refused.value) and "!!!" not in str(refused.value)


def test_a_token_of_another_type_is_refused() -> None:
    encoded = bytearray(_issue().encode())
    encoded[1] = 0x01
    with pytest.raises(UnsupportedTokenTypeError):
        parse_authorization("PrivateToken token=" + b64url_encode(bytes(encoded)))


def test_malformed_challenges_are_refused() -> None:
    good = encode_www_authenticate(CHALLENGE, [_key().token_key])
    for value in [
        good.replace("token-key", "token_key"),
        good.replace('challenge="', 'challenge="!'),
        ", ".join([good] * 17),
        good + ", " + good.split(", ")[1],
        'PrivateToken challenge="AAIA", token-key="AA=="',
    ]:
        with pytest.raises(MalformedError):
            parse_www_authenticate(value)


def test_a_challenge_with_a_bad_redemption_context_is_refused() -> None:
    with pytest.raises(MalformedError):
        decode_token_challenge(CHALLENGE.encode()[:-19] + b"\x05abcde" + CHALLENGE.encode()[-19:])


def test_directory_round_trip_and_strictness() -> None:
    directory = IssuerDirectory("https://issuer.veil.test/token-request", (DirectoryKey(_key().token_key, 1700000000),))
    decoded = decode_directory(encode_directory(directory))
    assert decoded == directory
    assert decoded.usable_keys(1699999999.0) == () and decoded.usable_keys(1700000000.0) == directory.keys
    skipped = b'{"issuer-request-uri": "u", "token-keys": [{"token-type": 1, "token-key": "AA=="}]}'
    assert decode_directory(skipped).keys == ()
    for body in [b"[]", b"{", b'{"issuer-request-uri": "u"}', b'{"issuer-request-uri": "u", "token-keys": [{"token-type": 2, "token-key": "AA=="}]}', b" " * 70000]:
        with pytest.raises(MalformedError):
            decode_directory(body)
