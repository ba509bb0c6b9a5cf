"""Anonymous authorization: the one place that decides whether a request may use the fleet.

When the policy's `[authorization]` lists issuer keys, a request that reaches a
node must carry one Privacy Pass token (RFC 9577/9578, type 2) in
`Authorization: PrivateToken token=...`: signed under a listed key, bound to
this gateway's challenge (its issuer and its origin), and never spent before.
Anything else is refused with 401 and a `WWW-Authenticate: PrivateToken`
challenge before a byte of the body is read or forwarded. With no keys listed
(the `dev` policy) every request is admitted.

The token is unlinkable to its issuance (blind signatures), and the hook keeps
it that way structurally: it receives the Authorization value and nothing else
about the connection (no address, no other header), and stores nothing but the
(key id, nonce) pair the spent-token store needs to refuse a second spend.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Header, Request
from starlette.concurrency import run_in_threadpool

from gateway.errors import GatewayError
from gateway.spent_tokens import SpentTokens
from ohttp.privacypass import (
    PrivacyPassError,
    TokenChallenge,
    TokenKey,
    encode_www_authenticate,
    parse_authorization,
    require_challenge,
    verify_token,
)

# Spent pairs are kept until the end of the retention window after the one they were spent in; every
# token spent in one window gets the same expiry, so the store's rows do not say when each was spent.
DEFAULT_RETENTION_S = 31 * 86400


@dataclass(frozen=True, slots=True)
class Admission:
    """The authorization decision for one request; it carries no identity by construction."""

    admitted: bool
    scheme: str
    key_id: bytes | None = None  # which issuer key signed the token (the same for every user of that key)


class TokenRequiredError(GatewayError):
    """The request has no acceptable token; the answer carries the PrivateToken challenge to get one."""

    status = 401
    code = "token_required"

    def __init__(self, message: str, www_authenticate: str) -> None:
        super().__init__(message)
        self.www_authenticate = www_authenticate


class ProcessSpentTokens:
    """Spent tokens held in this process only: for one gateway process (use a shared store for more)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._spent: dict[tuple[bytes, bytes], float] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def spend(self, key_id: bytes, nonce: bytes, expires_at: float) -> bool:
        now = self._clock()
        with self._lock:
            if len(self._spent) % 1024 == 0:
                self._spent = {pair: until for pair, until in self._spent.items() if until > now}
            if expires_at <= now or (key_id, nonce) in self._spent:
                return False
            self._spent[(key_id, nonce)] = expires_at
            return True

    def close(self) -> None:
        self._spent.clear()


@dataclass(slots=True)
class TokenGate:
    """Checks one token against the trusted keys and this gateway's challenge, and spends it."""

    challenge: TokenChallenge
    trusted: Mapping[bytes, TokenKey]
    spent: SpentTokens
    retention_s: float = DEFAULT_RETENTION_S
    clock: Callable[[], float] = time.time
    # Tokens accepted and refused per issuer key id (hex; "unknown" when no listed key is named):
    # counts only, never a nonce, a time or anything about the requester.
    decisions: Counter[tuple[str, bool]] = field(default_factory=Counter)
    _challenge_header: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self._challenge_header = encode_www_authenticate(self.challenge, list(self.trusted.values()))

    def admit(self, authorization: str | None) -> Admission:
        """Admit a request carrying a valid, unspent token; raise TokenRequiredError otherwise."""
        if authorization is None:
            self._refuse(None, "this gateway requires a Privacy Pass token: obtain one from the issuer")
        try:
            token = parse_authorization(authorization)
            verify_token(token, self.trusted)
            require_challenge(token, self.challenge.digest())
        except PrivacyPassError as error:
            self._refuse(None, f"the token is not acceptable ({type(error).__name__}): obtain a fresh one")
        if not self.spent.spend(token.token_key_id, token.nonce, self._expiry()):
            self._refuse(token.token_key_id, "the token was spent already: every request needs a fresh token")
        self._count(token.token_key_id, True)
        return Admission(admitted=True, scheme="privacypass", key_id=token.token_key_id)

    def _expiry(self) -> float:
        window = math.floor(self.clock() / self.retention_s)
        return (window + 2) * self.retention_s

    def _count(self, key_id: bytes | None, accepted: bool) -> None:
        name = key_id.hex() if key_id is not None and key_id in self.trusted else "unknown"
        self.decisions[(name, accepted)] += 1

    def _refuse(self, key_id: bytes | None, message: str) -> None:
        self._count(key_id, False)
        raise TokenRequiredError(message, self._challenge_header)


_OPEN_ADMISSION = Admission(admitted=True, scheme="open")


def _gate_of(request: Request) -> TokenGate | None:
    return request.app.state.runtime.token_gate


async def authorize_anonymously(
    authorization: Annotated[str | None, Header()] = None,
    gate: TokenGate | None = Depends(_gate_of),
) -> Admission:
    """Admit the request if the policy demands no token, or if its one token is valid and unspent."""
    if gate is None:
        return _OPEN_ADMISSION
    # Verification and a store round trip may block; the event loop keeps serving meanwhile.
    return await run_in_threadpool(gate.admit, authorization)
