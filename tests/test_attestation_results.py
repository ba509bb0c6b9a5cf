"""Signed attestation results (ES384 JWT) and NVIDIA NRAS EAT tokens against a pinned key set."""

from __future__ import annotations

import hashlib
import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from attestation.backends.sim import SimBackend
from attestation.errors import NrasTokenError, ResultTokenError
from attestation.nras import verify_nras_eat
from attestation.results import issue_result, verify_result
from attestation.verifier import verify
from tests.test_attestation_support import (  # noqa: F401  (fixtures)
    NONCE,
    code_digest,
    collect,
    dev_policy,
    sim_root_dir,
)

SIGNING_KEY = ec.generate_private_key(ec.SECP384R1())
ISSUER = "https://gateway.veil.test"


@pytest.fixture()
def node(code_digest):
    return verify(collect(SimBackend(), dev_policy(), code_digest), dev_policy())


def test_result_round_trip(node):
    token = issue_result(node, SIGNING_KEY, issuer=ISSUER, key_id="gw-1")
    result = verify_result(token, {"gw-1": SIGNING_KEY.public_key()}, issuer=ISSUER)
    assert result.node_id == node.node_id and result.key_config == node.key_config
    assert result.measurement == node.measurement and result.policy_digest == node.policy_digest
    assert result.simulated is True and result.expires_at == int(node.expires_at)
    assert [name for name, _ in result.checks] == [check.name for check in node.checks]
    assert jwt.get_unverified_header(token)["alg"] == "ES384"


def test_result_refusals(node):
    token = issue_result(node, SIGNING_KEY, issuer=ISSUER, key_id="gw-1")
    keys = {"gw-1": SIGNING_KEY.public_key()}
    other = ec.generate_private_key(ec.SECP384R1())
    with pytest.raises(ResultTokenError, match="does not pin"):
        verify_result(token, {"gw-2": SIGNING_KEY.public_key()}, issuer=ISSUER)
    with pytest.raises(ResultTokenError, match="does not verify"):
        verify_result(token, {"gw-1": other.public_key()}, issuer=ISSUER)
    with pytest.raises(ResultTokenError, match="does not verify"):
        verify_result(token, keys, issuer="https://someone-else")
    with pytest.raises(ResultTokenError, match="expired"):
        verify_result(token, keys, issuer=ISSUER, now=node.expires_at + 1)
    head, body, signature = token.split(".")
    with pytest.raises(ResultTokenError):
        verify_result(f"{head}.{body[:-2]}AA.{signature}", keys, issuer=ISSUER)
    with pytest.raises(ResultTokenError, match="P-384"):
        issue_result(node, ec.generate_private_key(ec.SECP256R1()), issuer=ISSUER, key_id="x")


def test_an_hs256_token_with_the_same_kid_is_refused(node):
    forged = jwt.encode({"iss": ISSUER, "sub": node.node_id, "iat": 0, "exp": 2**40}, "s" * 32,
                        algorithm="HS256", headers={"kid": "gw-1"})
    with pytest.raises(ResultTokenError, match="ES384"):
        verify_result(forged, {"gw-1": SIGNING_KEY.public_key()}, issuer=ISSUER)


# --- NRAS ---------------------------------------------------------------------------------------

NRAS_KEY = ec.generate_private_key(ec.SECP384R1())
JWKS = {"keys": [{**json.loads(jwt.algorithms.ECAlgorithm.to_jwk(NRAS_KEY.public_key())), "kid": "nras-1", "alg": "ES384"}]}
NOW = int(time.time())


def _sign(claims, key=NRAS_KEY, kid="nras-1"):
    return jwt.encode(claims, key, algorithm="ES384", headers={"kid": kid})


def nras_response(gpu_changes=None, overall_changes=None, *, gpu_key=NRAS_KEY, digest=None):
    base = {"iss": "https://nras.attestation.nvidia.com", "iat": NOW, "nbf": NOW, "exp": NOW + 3600,
            "eat_nonce": NONCE.hex()}
    gpu = _sign({**base, "measres": "success", "dbgstat": "disabled", "hwmodel": "GH100 A01 GSP BROM",
                 "x-nvidia-gpu-attestation-report-signature-verified": True, **(gpu_changes or {})}, gpu_key)
    overall = {**base, "x-nvidia-overall-att-result": True,
               "submods": {"GPU-0": ["DIGEST", ["SHA256", digest or hashlib.sha256(gpu.encode()).hexdigest()]]},
               **(overall_changes or {})}
    return json.dumps([["JWT", _sign(overall)], {"GPU-0": gpu}])


def test_a_good_nras_response_verifies():
    result = verify_nras_eat(nras_response(), JWKS, expected_nonce=NONCE)
    assert result.overall["x-nvidia-overall-att-result"] is True
    assert result.gpus["GPU-0"]["measres"] == "success"


@pytest.mark.parametrize(
    "response,message",
    [
        (lambda: nras_response(overall_changes={"x-nvidia-overall-att-result": False}), "attestation failed"),
        (lambda: nras_response(overall_changes={"eat_nonce": "00" * 32}), "different nonce"),
        (lambda: nras_response(gpu_changes={"eat_nonce": "00" * 32}), "different nonce"),
        (lambda: nras_response(overall_changes={"exp": NOW - 1}), "expired"),
        (lambda: nras_response(digest="00" * 32), "does not match its digest"),
        (lambda: nras_response(overall_changes={"submods": {}}), "submodules"),
        (lambda: nras_response(gpu_changes={"measres": "fail"}), "reference values"),
        (lambda: nras_response(gpu_changes={"dbgstat": "enabled"}), "debugging"),
        (lambda: nras_response(gpu_changes={"x-nvidia-gpu-arch-check": False}), "failed GPU checks"),
        (lambda: nras_response(gpu_key=ec.generate_private_key(ec.SECP384R1())), "does not verify"),
        (lambda: json.dumps([["JWT", _sign({"eat_nonce": NONCE.hex(), "exp": NOW + 60, "iat": NOW}, kid="other")], {}]),
         "pinned key"),
        (lambda: "[]", "not an NRAS v3 response"),
        (lambda: json.dumps([["JWS", "x"], {}]), "not an NRAS v3 response"),
    ],
)
def test_nras_refusals(response, message):
    with pytest.raises(NrasTokenError, match=message):
        verify_nras_eat(response(), JWKS, expected_nonce=NONCE)


def test_nras_expected_nonce_must_match():
    with pytest.raises(NrasTokenError, match="nonce"):
        verify_nras_eat(nras_response(), JWKS, expected_nonce=bytes(32))
