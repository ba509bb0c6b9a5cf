"""Verification of NVIDIA Remote Attestation Service (NRAS) results against a pinned key set.

An NRAS v3 response is a JSON list ``[["JWT", overall], {"GPU-0": gpu_token, ...}]``.
The overall EAT token carries ``eat_nonce``, ``x-nvidia-overall-att-result``
and ``submods``: for each GPU, ``["DIGEST", ["SHA256", hex(SHA-256(gpu_token))]]``,
which binds the detached per-GPU tokens. Every token is ES384, signed by the key
named by its ``kid`` in the pinned JWKS; nothing is fetched at run time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jwt

from attestation.errors import NrasTokenError

ALGORITHM = "ES384"
_DIGEST_NAMES = ("SHA256", "SHA-256")


@dataclass(frozen=True, slots=True)
class NrasResult:
    """A verified NRAS answer: the overall claims and each GPU's claims, by submodule name."""

    overall: Mapping[str, Any]
    gpus: Mapping[str, Mapping[str, Any]]


def verify_nras_eat(
    response: str | list,
    jwks: Mapping[str, Any],
    *,
    expected_nonce: bytes,
    now: float | None = None,
) -> NrasResult:
    """Verify an NRAS response: signatures, lifetime, nonce, overall verdict, detached GPU claims."""
    overall_token, detached = _split(response)
    keys = _key_set(jwks)
    moment = time.time() if now is None else now
    overall = _decode(overall_token, keys, moment, expected_nonce, "overall")
    if overall.get("x-nvidia-overall-att-result") is not True:
        raise NrasTokenError("NRAS reports that attestation failed (x-nvidia-overall-att-result is not true)")
    submods = overall.get("submods")
    if not isinstance(submods, dict) or set(submods) != set(detached) or not detached:
        raise NrasTokenError("the NRAS submodules do not match the detached GPU tokens")
    gpus = {name: _gpu_claims(name, submods[name], detached[name], keys, moment, expected_nonce) for name in detached}
    return NrasResult(overall=overall, gpus=gpus)


def _split(response: str | list) -> tuple[str, dict[str, str]]:
    try:
        value = json.loads(response) if isinstance(response, str) else response
        (kind, overall), detached = value[0], value[1]
    except (ValueError, TypeError, IndexError, KeyError):
        raise NrasTokenError("not an NRAS v3 response ([[\"JWT\", token], {gpu: token}])") from None
    if kind != "JWT" or not isinstance(overall, str) or not isinstance(detached, dict):
        raise NrasTokenError("not an NRAS v3 response ([[\"JWT\", token], {gpu: token}])")
    if not all(isinstance(token, str) for token in detached.values()):
        raise NrasTokenError("an NRAS detached GPU token is not a string")
    return overall, detached


def _key_set(jwks: Mapping[str, Any]) -> dict[str, jwt.PyJWK]:
    try:
        return {key.key_id: key for key in jwt.PyJWKSet.from_dict(dict(jwks)).keys if key.key_id}
    except jwt.PyJWTError:
        raise NrasTokenError("the pinned NRAS key set is not a valid JWKS") from None


def _decode(token: str, keys: dict[str, jwt.PyJWK], moment: float, nonce: bytes, what: str) -> dict[str, Any]:
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise NrasTokenError(f"the NRAS {what} token is not a JWT") from None
    key = keys.get(header.get("kid"))
    if header.get("alg") != ALGORITHM or key is None:
        raise NrasTokenError(f"the NRAS {what} token is not ES384 signed by a pinned key")
    try:
        claims = jwt.decode(token, key.key, algorithms=[ALGORITHM],
                            options={"require": ["exp", "iat", "eat_nonce"], "verify_exp": False,
                                     "verify_iat": False, "verify_nbf": False, "verify_aud": False})
    except jwt.PyJWTError as error:
        raise NrasTokenError(f"the NRAS {what} token does not verify: {type(error).__name__}") from None
    if moment >= claims["exp"] or claims.get("nbf", claims["iat"]) > moment + 60:
        raise NrasTokenError(f"the NRAS {what} token is expired or not yet valid")
    if not isinstance(claims["eat_nonce"], str) or not hmac.compare_digest(claims["eat_nonce"].lower(), nonce.hex()):
        raise NrasTokenError(f"the NRAS {what} token answers a different nonce")
    return claims


def _gpu_claims(name: str, submod: Any, token: str, keys, moment: float, nonce: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(token.encode("ascii")).hexdigest()
    try:
        tag, (algorithm, value) = submod
    except (TypeError, ValueError):
        raise NrasTokenError(f"the NRAS submodule {name} is not a DIGEST entry") from None
    if tag != "DIGEST" or algorithm not in _DIGEST_NAMES or not hmac.compare_digest(str(value).lower(), digest):
        raise NrasTokenError(f"the detached NRAS token for {name} does not match its digest in the overall token")
    claims = _decode(token, keys, moment, nonce, name)
    if claims.get("measres") != "success":
        raise NrasTokenError(f"NRAS reports that {name}'s measurements do not match reference values")
    if claims.get("dbgstat", "disabled") != "disabled":
        raise NrasTokenError(f"NRAS reports that {name} has debugging enabled")
    failed = [claim for claim, value in claims.items() if claim.startswith("x-nvidia-") and value is False]
    if failed:
        raise NrasTokenError(f"NRAS reports failed GPU checks for {name}: {sorted(failed)[:3]}")
    return claims
