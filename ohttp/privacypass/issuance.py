"""The token type 2 issuance and redemption steps (RFC 9578 §6): client, issuer, verifier.

Blind RSA here is RSABSSA-SHA384-PSS-Deterministic: token_input already carries a
fresh 32-byte nonce, so no message prefix is added (RFC 9578 §6.1).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric import rsa

from . import blind_rsa
from .errors import ChallengeMismatchError, UnknownTokenKeyError
from .token_key import TokenKey, token_key_from_public_key
from .wire import (
    NONCE_LENGTH,
    Token,
    TokenChallenge,
    TokenRequest,
    decode_token_request,
    decode_token_response,
)

VARIANT = blind_rsa.PSS_DETERMINISTIC


@dataclass(frozen=True, slots=True)
class PendingToken:
    """A request on its way to the issuer and what the client needs to finish it; nothing here is logged."""

    request: TokenRequest
    token_key: TokenKey = field(repr=False)
    unsigned: Token = field(repr=False)
    blinding: blind_rsa.Blinding = field(repr=False)


@dataclass(frozen=True, slots=True)
class IssuerKey:
    """An issuer's private key with its published public form, and its signer (the key's numbers, read once)."""

    private_key: rsa.RSAPrivateKey = field(repr=False)
    token_key: TokenKey
    signer: blind_rsa.BlindSigner = field(repr=False, compare=False)


def issuer_key(private_key: rsa.RSAPrivateKey) -> IssuerKey:
    return IssuerKey(private_key=private_key, token_key=token_key_from_public_key(private_key.public_key()),
                     signer=blind_rsa.BlindSigner.of(private_key))


def begin_issuance(
    token_key: TokenKey,
    challenge: TokenChallenge,
    *,
    _nonce_for_tests: bytes | None = None,
    _salt_for_tests: bytes | None = None,
    _blind_for_tests: int | None = None,
) -> PendingToken:
    """Client: a fresh nonce, token_input bound to the challenge and key, blinded into a TokenRequest."""
    nonce = os.urandom(NONCE_LENGTH) if _nonce_for_tests is None else _nonce_for_tests
    if len(nonce) != NONCE_LENGTH:
        raise ValueError(f"the nonce must be {NONCE_LENGTH} bytes")
    unsigned = Token(nonce, challenge.digest(), token_key.key_id, b"")
    blinding = blind_rsa.blind(
        token_key.public_key, VARIANT, unsigned.token_input(),
        _salt_for_tests=_salt_for_tests, _blind_for_tests=_blind_for_tests,
    )
    request = TokenRequest(token_key.truncated_key_id, blinding.blinded_msg)
    return PendingToken(request=request, token_key=token_key, unsigned=unsigned, blinding=blinding)


def finish_issuance(pending: PendingToken, token_response: bytes) -> Token:
    """Client: unblind the issuer's answer and verify the token under the issuer's key before keeping it."""
    blind_sig = decode_token_response(token_response)
    authenticator = blind_rsa.finalize(
        pending.token_key.public_key, VARIANT, pending.unsigned.token_input(), blind_sig, pending.blinding
    )
    unsigned = pending.unsigned
    return Token(unsigned.nonce, unsigned.challenge_digest, unsigned.token_key_id, authenticator)


def answer_token_request(keys: Iterable[IssuerKey], request_body: bytes) -> bytes:
    """Issuer: the TokenResponse (the blind signature) for a TokenRequest under the key it names."""
    request = decode_token_request(request_body)
    for key in keys:
        if key.token_key.truncated_key_id == request.truncated_token_key_id:
            return key.signer.sign(request.blinded_msg)
    raise UnknownTokenKeyError("the token request names a key this issuer does not hold: fetch its directory")


def verify_token(token: Token, keys: Mapping[bytes, TokenKey]) -> TokenKey:
    """Verifier: the key that signed this token, or UnknownTokenKeyError / InvalidSignatureError."""
    token_key = keys.get(token.token_key_id)
    if token_key is None:
        raise UnknownTokenKeyError("the token was issued under a key this verifier does not trust")
    blind_rsa.verify(token_key.public_key, VARIANT, token.token_input(), token.authenticator)
    return token_key


def require_challenge(token: Token, challenge_digest: bytes) -> None:
    """Refuse a token bound to a different challenge (another origin, issuer or context)."""
    if not hmac.compare_digest(token.challenge_digest, challenge_digest):
        raise ChallengeMismatchError("the token was issued for a different challenge: request a token for this origin")
