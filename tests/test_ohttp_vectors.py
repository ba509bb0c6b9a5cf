"""RFC 9458 Appendix A and the chunked OHTTP draft's example, reproduced byte for byte."""

from __future__ import annotations

import json

import pytest

from ohttp import hpke
from ohttp.chunked import ChunkedRequestOpener, ChunkedRequestSealer
from ohttp.encapsulation import RequestHeader, derive_response_key
from ohttp.keys import KeyConfig, KeyPair, KeyRing
from ohttp.message import REQUEST_LABEL, RESPONSE_LABEL, ClientRequest, decapsulate_request
from tests.conftest import vectors_path


def _load(name: str) -> dict:
    return json.loads((vectors_path() / name).read_text())


def _hex(vector: dict, field: str) -> bytes:
    return bytes.fromhex(vector[field])


@pytest.fixture(scope="module")
def rfc() -> dict:
    return _load("ohttp-rfc9458.json")


@pytest.fixture(scope="module")
def chunked() -> dict:
    return _load("ohttp-chunked.json")


def _split(data: bytes, sizes: list[int]) -> list[bytes]:
    parts, at = [], 0
    for size in sizes:
        parts.append(data[at : at + size])
        at += size
    assert at == len(data), "the vector's chunk sizes cover the whole message"
    return parts


# --- RFC 9458 --------------------------------------------------------------------------


def test_key_config_decodes_and_reencodes_identically(rfc: dict) -> None:
    config = KeyConfig.decode(_hex(rfc, "key_config"))
    assert (config.key_id, config.kem_id) == (rfc["key_id"], rfc["kem_id"])
    assert (rfc["kdf_id"], rfc["aead_id"]) == (config.suites[0].kdf_id, config.suites[0].aead_id)
    assert config.encode() == _hex(rfc, "key_config")


def test_private_key_yields_the_published_config(rfc: dict) -> None:
    config = KeyConfig.decode(_hex(rfc, "key_config"))
    pair = KeyPair.from_private_bytes(config.key_id, _hex(rfc, "skR"), config.suites)
    assert pair.config == config


def test_ephemeral_key_yields_published_pke(rfc: dict) -> None:
    kem = hpke.kem_for(rfc["kem_id"])
    assert kem.public_key_bytes(kem.private_key_from_bytes(_hex(rfc, "skE"))) == _hex(rfc, "pkE")


def test_hpke_info_matches(rfc: dict) -> None:
    header = RequestHeader(rfc["key_id"], rfc["kem_id"], rfc["kdf_id"], rfc["aead_id"])
    assert header.hpke_info(REQUEST_LABEL) == _hex(rfc, "info")


def test_client_encapsulation_matches(rfc: dict) -> None:
    config = KeyConfig.decode(_hex(rfc, "key_config"))
    blob, _ = ClientRequest.encapsulate(
        config, _hex(rfc, "bhttp_request"), _ephemeral_private_key_for_tests=_hex(rfc, "skE")
    )
    assert blob == _hex(rfc, "encapsulated_request")


def _gateway(vector: dict) -> KeyRing:
    config = KeyConfig.decode(_hex(vector, "key_config"))
    return KeyRing(KeyPair.from_private_bytes(config.key_id, _hex(vector, "skR"), config.suites))


def test_gateway_decapsulates_and_derives_every_response_value(rfc: dict) -> None:
    plaintext, server = decapsulate_request(_gateway(rfc), _hex(rfc, "encapsulated_request"))
    assert plaintext == _hex(rfc, "bhttp_request")
    context = server._context
    assert context.export(RESPONSE_LABEL, 16) == _hex(rfc, "exported_secret")
    assert _hex(rfc, "salt") == _hex(rfc, "pkE") + _hex(rfc, "response_nonce")
    kdf = hpke.kdf_for(rfc["kdf_id"])
    assert kdf.extract(_hex(rfc, "salt"), _hex(rfc, "exported_secret")) == _hex(rfc, "prk")
    assert kdf.expand(_hex(rfc, "prk"), b"key", 16) == _hex(rfc, "aead_key")
    key = derive_response_key(context, server.suite, _hex(rfc, "pkE"), _hex(rfc, "response_nonce"), RESPONSE_LABEL)
    assert key.nonce == _hex(rfc, "aead_nonce")


def test_gateway_response_matches_and_client_opens_it(rfc: dict) -> None:
    config = KeyConfig.decode(_hex(rfc, "key_config"))
    blob, client = ClientRequest.encapsulate(
        config, _hex(rfc, "bhttp_request"), _ephemeral_private_key_for_tests=_hex(rfc, "skE")
    )
    _, server = decapsulate_request(_gateway(rfc), blob)
    response = server.seal_response(_hex(rfc, "bhttp_response"), _response_nonce_for_tests=_hex(rfc, "response_nonce"))
    assert response == _hex(rfc, "encapsulated_response")
    assert client.open_response(_hex(rfc, "encapsulated_response")) == _hex(rfc, "bhttp_response")


# --- Chunked OHTTP ---------------------------------------------------------------------


def test_chunked_config_and_info(chunked: dict) -> None:
    config = KeyConfig.decode(_hex(chunked, "key_config"))
    assert config.encode() == _hex(chunked, "key_config")
    assert _gateway(chunked).current.config == config
    header = RequestHeader(config.key_id, config.kem_id, config.suites[0].kdf_id, config.suites[0].aead_id)
    assert header.hpke_info(b"message/bhttp chunked request") == _hex(chunked, "info")
    kem = hpke.kem_for(config.kem_id)
    assert kem.public_key_bytes(kem.private_key_from_bytes(_hex(chunked, "skE"))) == _hex(chunked, "pkE")


def _sealed_chunked_request(vector: dict) -> tuple[bytes, ChunkedRequestSealer]:
    config = KeyConfig.decode(_hex(vector, "key_config"))
    sealer = ChunkedRequestSealer(config, _ephemeral_private_key_for_tests=_hex(vector, "skE"))
    parts = _split(_hex(vector, "bhttp_request"), vector["request_chunk_sizes"])
    wire = b"".join(sealer.seal_chunk(part, final=i == len(parts) - 1) for i, part in enumerate(parts))
    return wire, sealer


def test_chunked_request_matches(chunked: dict) -> None:
    wire, _ = _sealed_chunked_request(chunked)
    assert wire == _hex(chunked, "encapsulated_request")


def test_chunked_request_opens_into_the_published_chunks(chunked: dict) -> None:
    opener = ChunkedRequestOpener(_gateway(chunked))
    opened = list(opener.chunks([_hex(chunked, "encapsulated_request")]))
    assert opened == _split(_hex(chunked, "bhttp_request"), chunked["request_chunk_sizes"])


def test_chunked_response_matches_and_every_derived_value(chunked: dict) -> None:
    opener = ChunkedRequestOpener(_gateway(chunked))
    list(opener.chunks([_hex(chunked, "encapsulated_request")]))
    context = opener._setup.context
    assert context.export(b"message/bhttp chunked response", 16) == _hex(chunked, "exported_secret")
    kdf = hpke.kdf_for(1)
    salt = _hex(chunked, "pkE") + _hex(chunked, "response_nonce")
    assert kdf.extract(salt, _hex(chunked, "exported_secret")) == _hex(chunked, "prk")
    assert kdf.expand(_hex(chunked, "prk"), b"key", 16) == _hex(chunked, "aead_key")
    assert kdf.expand(_hex(chunked, "prk"), b"nonce", 12) == _hex(chunked, "aead_base_nonce")
    sealer = opener.response_sealer(_response_nonce_for_tests=_hex(chunked, "response_nonce"))
    parts = _split(_hex(chunked, "bhttp_response"), chunked["response_chunk_sizes"])
    wire = b"".join(sealer.seal_chunk(part, final=i == len(parts) - 1) for i, part in enumerate(parts))
    assert wire == _hex(chunked, "encapsulated_response")


def test_chunked_response_opens_byte_by_byte(chunked: dict) -> None:
    _, sealer = _sealed_chunked_request(chunked)
    opener = sealer.response_opener()
    wire = _hex(chunked, "encapsulated_response")
    opened = [chunk for i in range(len(wire)) for chunk in opener.feed(wire[i : i + 1])]
    opened.append(opener.finish())
    assert b"".join(opened) == _hex(chunked, "bhttp_response")
    assert [c for c in opened if c] == [c for c in _split(_hex(chunked, "bhttp_response"), [1, 2, 0]) if c]
