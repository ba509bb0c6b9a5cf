"""Signed attestation results (ES384 JWT): issued for a verified node, verified against pinned keys."""

from __future__ import annotations

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from attestation.backends.sim import SimBackend
from attestation.errors import ResultTokenError
from attestation.results import issue_result, verify_result
from attestation.verifier import verify
from tests.test_attestation_support import (  # noqa: F401  (fixtures)
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

