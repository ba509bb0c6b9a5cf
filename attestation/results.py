"""Signed attestation results: what a verifier (the gateway at admission) checked, as an ES384 JWT.

Claims: ``iss``, ``sub`` (node id), ``iat``, ``exp`` (the evidence's expiry),
and ``veil``: the key configuration (base64url), the measurement digests and
policy digest (hex), the backend, whether the evidence was simulated, and each
check's name and outcome. Clients can audit what was admitted; they still
verify the evidence itself before sending anything.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec

from attestation.errors import ResultTokenError
from attestation.measurement import Measurement
from attestation.verifier import VerifiedNode

ALGORITHM = "ES384"


@dataclass(frozen=True, slots=True)
class AttestationResult:
    """A verified result token's content."""

    issuer: str
    node_id: str
    issued_at: int
    expires_at: int
    key_config: bytes
    measurement: Measurement
    policy_digest: bytes
    backend: str
    simulated: bool
    checks: tuple[tuple[str, bool], ...]


def issue_result(
    node: VerifiedNode,
    signing_key: ec.EllipticCurvePrivateKey,
    *,
    issuer: str,
    key_id: str,
    now: float | None = None,
) -> str:
    """Sign `node` as an attestation result token."""
    if not isinstance(signing_key, ec.EllipticCurvePrivateKey) or signing_key.curve.name != "secp384r1":
        raise ResultTokenError("attestation results are signed with an ECDSA P-384 key (ES384)")
    issued = int(time.time() if now is None else now)
    claims = {
        "iss": issuer,
        "sub": node.node_id,
        "iat": issued,
        "exp": int(node.expires_at),
        "veil": {
            "key_config": _b64url(node.key_config),
            "measurement": {
                "code": node.measurement.code_digest.hex(),
                "policy": node.measurement.policy_digest.hex(),
                "model": node.measurement.model_digest.hex(),
            },
            "policy_digest": node.policy_digest.hex(),
            "backend": node.backend,
            "simulated": node.simulated,
            "checks": [[check.name, bool(check.passed)] for check in node.checks],
        },
    }
    return jwt.encode(claims, signing_key, algorithm=ALGORITHM, headers={"kid": key_id})


def verify_result(
    token: str,
    public_keys: Mapping[str, ec.EllipticCurvePublicKey],
    *,
    issuer: str,
    now: float | None = None,
) -> AttestationResult:
    """Verify a result token's signature (key chosen by `kid`), issuer, lifetime and content."""
    key = public_keys.get(_key_id(token))
    if key is None:
        raise ResultTokenError("the result token is signed by a key this verifier does not pin")
    try:
        claims = jwt.decode(
            token, key, algorithms=[ALGORITHM], issuer=issuer,
            options={"require": ["iss", "sub", "iat", "exp"], "verify_exp": False, "verify_iat": False},
        )
    except jwt.PyJWTError as error:
        raise ResultTokenError(f"the result token does not verify: {type(error).__name__}") from None
    moment = time.time() if now is None else now
    if not claims["iat"] <= moment + 60 or moment >= claims["exp"]:
        raise ResultTokenError("the result token is expired or issued in the future")
    return _result_from_claims(claims)


def _result_from_claims(claims: dict[str, Any]) -> AttestationResult:
    try:
        veil = claims["veil"]
        checks = tuple((str(name), bool(passed)) for name, passed in veil["checks"])
        result = AttestationResult(
            issuer=claims["iss"], node_id=claims["sub"], issued_at=int(claims["iat"]), expires_at=int(claims["exp"]),
            key_config=base64.urlsafe_b64decode(veil["key_config"] + "=" * (-len(veil["key_config"]) % 4)),
            measurement=Measurement(*(bytes.fromhex(veil["measurement"][part]) for part in ("code", "policy", "model"))),
            policy_digest=bytes.fromhex(veil["policy_digest"]), backend=str(veil["backend"]),
            simulated=bool(veil["simulated"]), checks=checks,
        )
    except (KeyError, TypeError, ValueError):
        raise ResultTokenError("the result token's veil claims are malformed") from None
    if not checks or not all(passed for _, passed in checks):
        raise ResultTokenError("the result token records a failed check")
    return result


def _key_id(token: str) -> str:
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise ResultTokenError("the result token is not a JWT") from None
    if header.get("alg") != ALGORITHM or not isinstance(header.get("kid"), str):
        raise ResultTokenError(f"the result token must be {ALGORITHM} with a key id")
    return header["kid"]


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")
