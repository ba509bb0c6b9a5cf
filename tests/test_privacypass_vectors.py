"""RFC 9474 Appendix A and RFC 9578 Appendix A.2, reproduced byte for byte, every intermediate value."""

from __future__ import annotations

import hashlib
import json

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from ohttp.privacypass import blind_rsa, openssl_rsa
from ohttp.privacypass.issuance import answer_token_request, begin_issuance, finish_issuance, issuer_key, verify_token
from ohttp.privacypass.pss import emsa_pss_encode
from ohttp.privacypass.token_key import decode_token_key
from ohttp.privacypass.wire import decode_token, decode_token_challenge
from tests.conftest import vectors_path

RFC9474 = json.loads((vectors_path() / "privacypass" / "rfc9474-rsabssa.json").read_text())["vectors"]
RFC9578 = json.loads((vectors_path() / "privacypass" / "rfc9578-type2-issuance.json").read_text())["vectors"]
VARIANTS = {variant.name: variant for variant in blind_rsa.VARIANTS}


def _h(vector: dict, name: str) -> bytes:
    return bytes.fromhex(vector[name])


def _i(vector: dict, name: str) -> int:
    return int(vector[name], 16)


def _private_key(vector: dict) -> rsa.RSAPrivateKey:
    p, q, d, e = _i(vector, "p"), _i(vector, "q"), _i(vector, "d"), _i(vector, "e")
    public = rsa.RSAPublicNumbers(e, p * q)
    numbers = rsa.RSAPrivateNumbers(
        p, q, d, rsa.rsa_crt_dmp1(d, p), rsa.rsa_crt_dmq1(d, q), rsa.rsa_crt_iqmp(p, q), public
    )
    return numbers.private_key()


@pytest.mark.parametrize("vector", RFC9474, ids=[v["name"] for v in RFC9474])
def test_rfc9474_every_step(vector: dict) -> None:
    variant = VARIANTS[vector["name"]]
    private_key = _private_key(vector)
    public_key = private_key.public_key()
    assert public_key.public_numbers().n == _i(vector, "n")

    prepared = blind_rsa.prepare(variant, _h(vector, "msg"), _msg_prefix_for_tests=_h(vector, "msg_prefix") or None)
    assert prepared == _h(vector, "prepared_msg")
    salt = _h(vector, "salt")
    assert emsa_pss_encode(prepared, public_key.key_size - 1, variant.salt_length, salt=salt) == _h(
        vector, "encoded_msg"
    )

    r = pow(_i(vector, "inv"), -1, _i(vector, "n"))
    blinding = blind_rsa.blind(public_key, variant, prepared, _salt_for_tests=salt, _blind_for_tests=r)
    assert blinding.inverse == _i(vector, "inv")
    assert blinding.blinded_msg == _h(vector, "blinded_msg")

    blind_sig = blind_rsa.blind_sign(private_key, blinding.blinded_msg)
    assert blind_sig == _h(vector, "blind_sig")
    assert blind_rsa.finalize(public_key, variant, prepared, blind_sig, blinding) == _h(vector, "sig")
    blind_rsa.verify(public_key, variant, prepared, _h(vector, "sig"))


@pytest.mark.parametrize("index", range(len(RFC9578)))
def test_rfc9578_type2_issuance_every_step(index: int) -> None:
    vector = RFC9578[index]
    private_key = serialization.load_pem_private_key(_h(vector, "skS"), password=None)
    key = issuer_key(private_key)
    assert key.token_key.spki == _h(vector, "pkS")
    assert key.token_key.key_id == hashlib.sha256(_h(vector, "pkS")).digest()
    assert decode_token_key(_h(vector, "pkS")).key_id == key.token_key.key_id

    challenge = decode_token_challenge(_h(vector, "token_challenge"))
    assert challenge.encode() == _h(vector, "token_challenge")

    pending = begin_issuance(
        key.token_key,
        challenge,
        _nonce_for_tests=_h(vector, "nonce"),
        _salt_for_tests=_h(vector, "salt"),
        _blind_for_tests=_i(vector, "blind"),
    )
    assert pending.request.encode() == _h(vector, "token_request")
    response = answer_token_request([key], pending.request.encode())
    assert response == _h(vector, "token_response")
    token = finish_issuance(pending, response)
    assert token.encode() == _h(vector, "token")

    decoded = decode_token(_h(vector, "token"))
    assert decoded == token
    assert verify_token(decoded, {key.token_key.key_id: key.token_key}) == key.token_key


def test_rfc9578_challenges_decode_to_the_published_fields() -> None:
    """The vectors' challenges: issuer.example, a 32-byte context in 1 and 5, the listed origins."""
    challenges = [decode_token_challenge(_h(v, "token_challenge")) for v in RFC9578]
    assert {c.issuer_name for c in challenges} == {"issuer.example"}
    assert [len(c.redemption_context) for c in challenges] == [32, 0, 0, 0, 32]
    assert [c.origin_info for c in challenges] == [
        ("origin.example",), ("origin.example",), ("foo.example", "bar.example"), (), (),
    ]
    assert [c.digest()[:4].hex() for c in challenges] == ["5969f643", "11e15c91", "0042eee4", "b741ec1b", "bb8a8cf1"]


def _private_operations(private_key: object) -> list[object]:
    """Every private-operation backend this machine has: GMP always, OpenSSL where libcrypto 3 is found."""
    backends = [blind_rsa.GmpCrt.of(private_key)]
    if openssl_rsa.load() is not None:
        backends.append(blind_rsa.OpenSSLCrt(openssl_rsa.OpenSSLRawSigner.of(openssl_rsa.load(), private_key)))
    return backends


def test_the_issuer_uses_openssl_where_this_machine_has_libcrypto_3() -> None:
    private_key = _private_key(RFC9474[0])
    expected = "gmp" if openssl_rsa.load() is None else "openssl"
    assert blind_rsa.BlindSigner.of(private_key).private.name == expected


@pytest.mark.parametrize("vector", RFC9474, ids=[v["name"] for v in RFC9474])
def test_rfc9474_blind_signature_from_each_private_operation(vector: dict) -> None:
    private_key = _private_key(vector)
    public = private_key.public_key().public_numbers()
    for private in _private_operations(private_key):
        signer = blind_rsa.BlindSigner(blind_rsa.gmpy2.mpz(public.n), blind_rsa.gmpy2.mpz(public.e), private,
                                       (private_key.key_size + 7) // 8)
        assert signer.sign(_h(vector, "blinded_msg")) == _h(vector, "blind_sig"), private.name
