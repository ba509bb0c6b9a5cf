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

A token pays for a request a node took. The token is spent before the body is
read (so a replay is refused at once), and given back (its spend forgotten)
when the gateway refuses the request before any node took it: the gateway or
every candidate at its bound (503), no admitted candidate (404), every candidate
failed before accepting (502), or a bad body. Only the request that spent the
token gives it back, once, after it has ended, so at no time are two requests
served on one token. A store outage spends nothing: 503 with Retry-After, and
the client sends the same token again.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, NoReturn

from fastapi import Depends, Header, Request
from starlette.concurrency import run_in_threadpool

from audit import TokenRefusal
from gateway.errors import FinalRefusalError, GatewayError, SpentTokensError
from serving.errors import ServingError
from gateway.spent_tokens import SpentTokens
from ohttp.privacypass import (
    PrivacyPassError,
    Token,
    TokenChallenge,
    TokenKey,
    UnknownTokenKeyError,
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
    # The token's nonce, for giving it back if no node takes the request; it dies with the request.
    nonce: bytes | None = field(default=None, repr=False)


class TokenRequiredError(GatewayError):
    """The request has no acceptable token; the answer carries the PrivateToken challenge to get one."""

    status = 401
    code = "token_required"

    def __init__(self, message: str, www_authenticate: str) -> None:
        super().__init__(message)
        self.www_authenticate = www_authenticate

    def headers(self) -> dict[str, str] | None:
        return {"www-authenticate": self.www_authenticate, "cache-control": "no-store"}


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

    def give_back(self, key_id: bytes, nonce: bytes) -> None:
        with self._lock:
            self._spent.pop((key_id, nonce), None)

    def close(self) -> None:
        self._spent.clear()


@dataclass(frozen=True, slots=True)
class KeyTally:
    """The decisions under one listed key (`key_id` hex), or under none (None), since the last take."""

    key_id: str | None
    accepted: int
    refused: Mapping[TokenRefusal, int]


class TokenDecisionCounts:
    """Tokens accepted and refused, per listed key and refusal reason, since the last `take`.

    Counts only: never a nonce, a time or anything about the requester. Requests are admitted on
    worker threads, so every update holds a lock (a Counter's `+=` is not atomic across threads).
    """

    def __init__(self) -> None:
        self._counts: Counter[tuple[str | None, TokenRefusal | None]] = Counter()
        self._lock = threading.Lock()

    def count(self, key_id: str | None, refusal: TokenRefusal | None) -> None:
        """One decision: accepted when `refusal` is None."""
        with self._lock:
            self._counts[(key_id, refusal)] += 1

    def take(self) -> list[KeyTally]:
        """The counts since the last take, one tally per key that has any, and start counting afresh."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        keys = sorted({key_id for key_id, _ in counts}, key=lambda key_id: key_id or "")
        return [KeyTally(key_id, counts[(key_id, None)], {reason: counts[(key_id, reason)] for reason in TokenRefusal})
                for key_id in keys]


@dataclass(slots=True)
class TokenGate:
    """Checks one token against the trusted keys and this gateway's challenge, and spends it."""

    challenge: TokenChallenge
    trusted: Mapping[bytes, TokenKey]
    spent: SpentTokens
    retention_s: float = DEFAULT_RETENTION_S
    clock: Callable[[], float] = time.time
    retry_after_s: int = 1  # what a client waits before sending its token again when the store is out
    # What the gateway's audit tally reports (see gateway.audit): counts per listed key and reason.
    decisions: TokenDecisionCounts = field(default_factory=TokenDecisionCounts)
    _challenge_header: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self._challenge_header = encode_www_authenticate(self.challenge, list(self.trusted.values()))

    def admit(self, authorization: str | None) -> Admission:
        """Admit a request carrying a valid, unspent token; raise TokenRequiredError otherwise."""
        if authorization is None:
            self._refuse(None, TokenRefusal.MISSING,
                         "this gateway requires a Privacy Pass token: obtain one from the issuer")
        token = self._verified(authorization)
        key_id = token.token_key_id.hex()
        try:
            require_challenge(token, self.challenge.digest())
        except PrivacyPassError as error:
            self._refuse(key_id, TokenRefusal.WRONG_CHALLENGE, _not_acceptable(error))
        try:
            first_spend = self.spent.spend(token.token_key_id, token.nonce, self._expiry())
        except SpentTokensError as error:
            self.decisions.count(key_id, TokenRefusal.STORE_UNREACHABLE)
            raise SpentTokensError(error.message, self.retry_after_s) from None
        if not first_spend:
            self._refuse(key_id, TokenRefusal.SPENT,
                         "the token was spent already: every request needs a fresh token")
        self.decisions.count(key_id, None)
        return Admission(admitted=True, scheme="privacypass", key_id=token.token_key_id, nonce=token.nonce)

    def give_back(self, admission: Admission) -> None:
        """Forget the spend of `admission`'s token (no node took its request); where the store is out, it stays
        spent: the client loses one token, and no token is ever spent twice."""
        if admission.key_id is None or admission.nonce is None:
            return
        try:
            self.spent.give_back(admission.key_id, admission.nonce)
        except SpentTokensError:
            pass

    def _verified(self, authorization: str) -> Token:
        """The token, signed under a listed key; a refusal counted under no key otherwise."""
        try:
            token = parse_authorization(authorization)
            verify_token(token, self.trusted)
        except UnknownTokenKeyError as error:
            self._refuse(None, TokenRefusal.UNKNOWN_KEY, _not_acceptable(error))
        except PrivacyPassError as error:
            # A signature that does not verify leaves the named key id unproven: counted under none.
            self._refuse(None, TokenRefusal.MALFORMED, _not_acceptable(error))
        return token

    def _expiry(self) -> float:
        window = math.floor(self.clock() / self.retention_s)
        return (window + 2) * self.retention_s

    def _refuse(self, key_id: str | None, reason: TokenRefusal, message: str) -> NoReturn:
        self.decisions.count(key_id, reason)
        raise TokenRequiredError(message, self._challenge_header)


def _not_acceptable(error: PrivacyPassError) -> str:
    return f"the token is not acceptable ({type(error).__name__}): obtain a fresh one"


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


@asynccontextmanager
async def token_back_unless_taken(gate: TokenGate | None, admission: Admission) -> AsyncIterator[None]:
    """Run the forwarding of a request; give its token back if the gateway refuses it before any node took it.

    A `FinalRefusalError` came from a node that had the request (it could not decrypt it, or may hold it):
    the token stays spent. Any other refusal was decided before a node took anything.
    """
    try:
        yield
    except ServingError as error:
        if gate is not None and not isinstance(error, FinalRefusalError):
            await run_in_threadpool(gate.give_back, admission)
        raise
