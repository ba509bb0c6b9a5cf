"""Key configurations, key pairs and the rotation key ring."""

from __future__ import annotations

import copy
import pickle
import struct

import pytest

from ohttp import hpke
from ohttp.errors import MalformedError, OHTTPError, UnknownKeyError, UnsupportedSuiteError
from ohttp.keys import (
    DEFAULT_SUITES,
    SUITE_AES_128_GCM,
    SUITE_CHACHA20_POLY1305,
    KeyConfig,
    KeyPair,
    KeyRing,
    SymmetricSuite,
    generate_key_pair,
)

FIXED_PRIVATE_KEY = bytes(range(1, 33))


def _config(key_id: int = 7, suites: tuple[SymmetricSuite, ...] = DEFAULT_SUITES) -> KeyConfig:
    return generate_key_pair(key_id, suites).config


def _raw_config(key_id: int, kem_id: int, public_key: bytes, suite_bytes: bytes, declared: int | None = None) -> bytes:
    length = len(suite_bytes) if declared is None else declared
    return struct.pack(">BH", key_id, kem_id) + public_key + struct.pack(">H", length) + suite_bytes


def test_generated_config_round_trips() -> None:
    config = _config()
    assert len(config.public_key) == 32
    assert config.suites == DEFAULT_SUITES
    assert KeyConfig.decode(config.encode()) == config


def test_decode_rejects_trailing_bytes() -> None:
    with pytest.raises(MalformedError):
        KeyConfig.decode(_config().encode() + b"\x00")


@pytest.mark.parametrize("key_length", [0, 31, 33])
def test_decode_rejects_wrong_key_length(key_length: int) -> None:
    data = _raw_config(1, 0x20, bytes(key_length), struct.pack(">HH", 1, 1))
    with pytest.raises(MalformedError):
        KeyConfig.decode(data)


def test_decode_rejects_empty_suite_list() -> None:
    with pytest.raises(MalformedError):
        KeyConfig.decode(_raw_config(1, 0x20, bytes(32), b""))


@pytest.mark.parametrize("declared", [3, 5, 8])
def test_decode_rejects_ragged_or_misdeclared_suite_list(declared: int) -> None:
    with pytest.raises(MalformedError):
        KeyConfig.decode(_raw_config(1, 0x20, bytes(32), struct.pack(">HH", 1, 1), declared=declared))


def test_decode_rejects_unknown_kem() -> None:
    with pytest.raises(UnsupportedSuiteError):
        KeyConfig.decode(_raw_config(1, 0x0010, bytes(65), struct.pack(">HH", 1, 1)))


def test_decode_rejects_config_without_any_implemented_suite() -> None:
    with pytest.raises(UnsupportedSuiteError):
        KeyConfig.decode(_raw_config(1, 0x20, bytes(32), struct.pack(">HHHH", 2, 1, 1, 0xFFFF)))


def test_decode_keeps_unimplemented_suites_beside_implemented_ones() -> None:
    data = _raw_config(1, 0x20, bytes(32), struct.pack(">HHHH", 2, 1, 1, 3))
    config = KeyConfig.decode(data)
    assert config.suites == (SymmetricSuite(2, 1), SUITE_CHACHA20_POLY1305)
    assert config.supported_suites() == (SUITE_CHACHA20_POLY1305,)
    assert config.encode() == data


def test_decode_rejects_every_strict_prefix() -> None:
    data = _config().encode()
    for end in range(len(data)):
        with pytest.raises(MalformedError):
            KeyConfig.decode(data[:end])


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        KeyConfig(256, 0x20, bytes(32), DEFAULT_SUITES)
    with pytest.raises(ValueError):
        KeyConfig(1, 0x20, bytes(31), DEFAULT_SUITES)
    with pytest.raises(ValueError):
        KeyConfig(1, 0x20, bytes(32), ())
    with pytest.raises(UnsupportedSuiteError):
        KeyConfig(1, 0x99, bytes(32), DEFAULT_SUITES)


# --- Key pairs -------------------------------------------------------------------------


def test_key_pair_never_shows_its_private_key() -> None:
    pair = KeyPair.from_private_bytes(5, FIXED_PRIVATE_KEY)
    for text in (repr(pair), str(pair), repr(pair.private_key), str(pair.private_key)):
        assert FIXED_PRIVATE_KEY.hex() not in text
        assert repr(FIXED_PRIVATE_KEY)[2:-1] not in text
        assert "redacted" in text


@pytest.mark.parametrize("export", [pickle.dumps, copy.copy, copy.deepcopy])
def test_key_pair_cannot_be_serialized_or_copied(export) -> None:
    pair = generate_key_pair(1)
    with pytest.raises(TypeError):
        export(pair)
    with pytest.raises(TypeError):
        export(pair.private_key)


def test_from_private_bytes_is_deterministic_and_generate_is_fresh() -> None:
    assert KeyPair.from_private_bytes(5, FIXED_PRIVATE_KEY).config == KeyPair.from_private_bytes(5, FIXED_PRIVATE_KEY).config
    assert generate_key_pair(1).config.public_key != generate_key_pair(1).config.public_key


def test_from_private_bytes_rejects_wrong_length() -> None:
    with pytest.raises(MalformedError):
        KeyPair.from_private_bytes(5, FIXED_PRIVATE_KEY[:31])


def test_key_pair_refuses_a_mismatched_config() -> None:
    pair = generate_key_pair(1)
    other = generate_key_pair(1)
    with pytest.raises(ValueError):
        KeyPair(other.config, pair.private_key)


def test_kem_registry_refuses_unknown_ids() -> None:
    assert hpke.kem_for(0x20).enc_length == 32
    with pytest.raises(UnsupportedSuiteError):
        hpke.kem_for(0x647A)


# --- Key ring --------------------------------------------------------------------------


def test_key_ring_rotation() -> None:
    first, second, third = generate_key_pair(1), generate_key_pair(2), generate_key_pair(3)
    ring = KeyRing(first)
    assert ring.current is first and ring.lookup(1) is first
    ring.rotate(second)
    assert ring.current is second
    assert ring.lookup(1) is first and ring.lookup(2) is second
    ring.rotate(third)
    with pytest.raises(UnknownKeyError):
        ring.lookup(1)
    assert ring.current is third and ring.lookup(2) is second
    ring.drop_previous()
    assert ring.lookup(3) is third
    with pytest.raises(UnknownKeyError):
        ring.lookup(2)


def test_key_ring_refuses_duplicate_ids() -> None:
    ring = KeyRing(generate_key_pair(1))
    with pytest.raises(ValueError):
        ring.rotate(generate_key_pair(1))
    with pytest.raises(ValueError):
        KeyRing(generate_key_pair(4), generate_key_pair(4))


def test_unknown_key_error_is_an_ohttp_error() -> None:
    with pytest.raises(OHTTPError):
        KeyRing(generate_key_pair(1)).lookup(200)
    assert SUITE_AES_128_GCM.is_supported and not SymmetricSuite(3, 1).is_supported


def test_a_newly_registered_kem_works_without_changing_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand-in for a future hybrid KEM: DHKEM(P-256), whose sizes differ from X25519's.
    from ohttp.message import ClientRequest, decapsulate_request

    p256 = hpke.PyhpkeKem(0x0010, "DHKEM(P-256, HKDF-SHA256)", 65, 32)
    monkeypatch.setitem(hpke._KEMS, 0x0010, p256)
    pair = generate_key_pair(8, kem_id=0x0010)
    assert len(pair.config.public_key) == 65
    config = KeyConfig.decode(pair.config.encode())
    blob, client = ClientRequest.encapsulate(config, b"question")
    assert len(blob) == 7 + 65 + len(b"question") + 16
    plaintext, server = decapsulate_request(KeyRing(pair), blob)
    assert plaintext == b"question"
    assert client.open_response(server.seal_response(b"answer")) == b"answer"
