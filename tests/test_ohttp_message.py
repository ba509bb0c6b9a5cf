"""Whole encapsulated requests and responses (RFC 9458 section 4): round trips and tampering."""

from __future__ import annotations

import struct

import pytest

from ohttp.errors import DecryptionError, MalformedError, OHTTPError, UnknownKeyError, UnsupportedSuiteError
from ohttp.keys import (
    DEFAULT_SUITES,
    SUITE_AES_128_GCM,
    SUITE_AES_256_GCM,
    SUITE_CHACHA20_POLY1305,
    KeyConfig,
    KeyRing,
    SymmetricSuite,
    generate_key_pair,
)
from ohttp.message import ClientRequest, decapsulate_request

PROMPT = b"the secret prompt: tell nobody about the vault code 4711"
ANSWER = b"the secret completion: understood, 4711 stays between us"


@pytest.fixture(scope="module")
def ring() -> KeyRing:
    return KeyRing(generate_key_pair(3))


def _assert_no_leak(error: BaseException) -> None:
    text = f"{error!r} {error}"
    for secret in (PROMPT, ANSWER):
        assert secret.decode() not in text and secret.hex() not in text
    assert error.__cause__ is None


@pytest.mark.parametrize("suite", [SUITE_AES_128_GCM, SUITE_AES_256_GCM, SUITE_CHACHA20_POLY1305])
def test_round_trip_with_each_suite(ring: KeyRing, suite: SymmetricSuite) -> None:
    blob, client = ClientRequest.encapsulate(ring.current.config, PROMPT, suite)
    assert blob[3:7] == struct.pack(">HH", suite.kdf_id, suite.aead_id)
    assert PROMPT not in blob
    plaintext, server = decapsulate_request(ring, blob)
    assert plaintext == PROMPT and server.suite == suite
    response = server.seal_response(ANSWER)
    assert ANSWER not in response
    assert client.open_response(response) == ANSWER


def test_empty_request_and_response(ring: KeyRing) -> None:
    blob, client = ClientRequest.encapsulate(ring.current.config, b"")
    plaintext, server = decapsulate_request(ring, blob)
    assert plaintext == b""
    assert client.open_response(server.seal_response(b"")) == b""


def test_each_request_gets_a_fresh_context(ring: KeyRing) -> None:
    first, _ = ClientRequest.encapsulate(ring.current.config, PROMPT)
    second, _ = ClientRequest.encapsulate(ring.current.config, PROMPT)
    assert first[7:39] != second[7:39]  # a new ephemeral key share each time
    assert first[39:] != second[39:]


def test_response_cannot_be_opened_with_another_requests_context(ring: KeyRing) -> None:
    blob_a, client_a = ClientRequest.encapsulate(ring.current.config, PROMPT)
    _, client_b = ClientRequest.encapsulate(ring.current.config, PROMPT)
    _, server_a = decapsulate_request(ring, blob_a)
    response = server_a.seal_response(ANSWER)
    with pytest.raises(DecryptionError) as caught:
        client_b.open_response(response)
    _assert_no_leak(caught.value)
    assert client_a.open_response(response) == ANSWER


def test_responses_use_fresh_nonces(ring: KeyRing) -> None:
    blob, client = ClientRequest.encapsulate(ring.current.config, PROMPT)
    _, server = decapsulate_request(ring, blob)
    first, second = server.seal_response(ANSWER), server.seal_response(ANSWER)
    assert first != second
    assert client.open_response(first) == client.open_response(second) == ANSWER


def test_every_single_bit_flip_of_a_request_is_detected(ring: KeyRing) -> None:
    blob, _ = ClientRequest.encapsulate(ring.current.config, PROMPT)
    for bit in range(len(blob) * 8):
        tampered = bytearray(blob)
        tampered[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(OHTTPError) as caught:
            decapsulate_request(ring, bytes(tampered))
        _assert_no_leak(caught.value)


def test_every_single_bit_flip_of_a_response_is_detected(ring: KeyRing) -> None:
    blob, client = ClientRequest.encapsulate(ring.current.config, PROMPT)
    _, server = decapsulate_request(ring, blob)
    response = server.seal_response(ANSWER)
    for bit in range(len(response) * 8):
        tampered = bytearray(response)
        tampered[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(DecryptionError):
            client.open_response(bytes(tampered))


def test_truncated_or_extended_messages_are_rejected(ring: KeyRing) -> None:
    blob, client = ClientRequest.encapsulate(ring.current.config, PROMPT)
    _, server = decapsulate_request(ring, blob)
    response = server.seal_response(ANSWER)
    for end in range(len(blob)):
        with pytest.raises(OHTTPError):
            decapsulate_request(ring, blob[:end])
    for end in range(len(response)):
        with pytest.raises(OHTTPError):
            client.open_response(response[:end])
    with pytest.raises(DecryptionError):
        decapsulate_request(ring, blob + b"\x00")
    with pytest.raises(DecryptionError):
        client.open_response(response + b"\x00")


def test_request_to_an_unknown_key_is_refused(ring: KeyRing) -> None:
    stranger = generate_key_pair(9)
    blob, _ = ClientRequest.encapsulate(stranger.config, PROMPT)
    with pytest.raises(UnknownKeyError):
        decapsulate_request(ring, blob)


def test_request_to_a_same_id_other_key_fails_to_decrypt(ring: KeyRing) -> None:
    impostor = generate_key_pair(ring.current.key_id)
    blob, _ = ClientRequest.encapsulate(impostor.config, PROMPT)
    with pytest.raises(DecryptionError):
        decapsulate_request(ring, blob)


def test_suite_the_key_does_not_accept_is_refused() -> None:
    pair = generate_key_pair(1, (SUITE_AES_128_GCM,))
    ring = KeyRing(pair)
    widened = KeyConfig(pair.config.key_id, pair.config.kem_id, pair.config.public_key, DEFAULT_SUITES)
    blob, _ = ClientRequest.encapsulate(widened, PROMPT, SUITE_CHACHA20_POLY1305)
    with pytest.raises(UnsupportedSuiteError):
        decapsulate_request(ring, blob)


def test_client_refuses_a_suite_the_config_does_not_offer() -> None:
    config = generate_key_pair(1, (SUITE_AES_128_GCM,)).config
    with pytest.raises(UnsupportedSuiteError):
        ClientRequest.encapsulate(config, PROMPT, SUITE_AES_256_GCM)


def test_client_picks_the_first_implemented_suite() -> None:
    config = generate_key_pair(1, (SymmetricSuite(3, 1), SUITE_CHACHA20_POLY1305)).config
    blob, client = ClientRequest.encapsulate(config, PROMPT)
    assert client.suite == SUITE_CHACHA20_POLY1305
    assert blob[3:7] == struct.pack(">HH", 1, 3)


def test_low_order_public_key_is_refused_by_the_client() -> None:
    config = KeyConfig(1, 0x20, bytes(32), DEFAULT_SUITES)
    with pytest.raises(MalformedError):
        ClientRequest.encapsulate(config, PROMPT)


def test_low_order_key_share_is_refused_by_the_gateway(ring: KeyRing) -> None:
    blob, _ = ClientRequest.encapsulate(ring.current.config, PROMPT)
    forged = blob[:7] + bytes(32) + blob[39:]
    with pytest.raises(DecryptionError):
        decapsulate_request(ring, forged)


def test_previous_key_still_opens_during_rotation() -> None:
    old, new = generate_key_pair(1), generate_key_pair(2)
    ring = KeyRing(old)
    blob, client = ClientRequest.encapsulate(old.config, PROMPT)
    ring.rotate(new)
    plaintext, server = decapsulate_request(ring, blob)
    assert plaintext == PROMPT and server.key_id == 1
    assert client.open_response(server.seal_response(ANSWER)) == ANSWER
    ring.drop_previous()
    with pytest.raises(UnknownKeyError):
        decapsulate_request(ring, blob)
