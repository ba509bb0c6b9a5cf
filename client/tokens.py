"""Privacy Pass tokens for the gateway: obtained blindly from the issuer in batches, each spent once.

The wallet asks the issuer to sign blinded token requests (RFC 9578 type 2),
so the issuer learns the account and the number of tokens but never the
tokens themselves; each answer is unblinded and verified under the issuer's
published key before it is kept. Tokens are bound to the gateway's origin
and the issuer named in the client's policy, kept in memory only, and handed
out one per request, never twice: a retried request takes a new one, unless the
gateway gave the first back unspent (`give_back`: it refused before any node took
the request), which links the two attempts no more than their timing already does.

Refills run on a background thread, a batch at a time, started when the wallet falls
to `refill_at` tokens, so a request takes a token without waiting for the issuer,
and never waits behind another thread's refill while tokens are left.

A wallet is bound to a policy's `[authorization]` section: it fetches tokens
only under a key that section lists (a policy listing none gets no wallet),
and `Client` refuses a wallet bound to another section than its own policy's,
so an issuer cannot give this client a key of its own to recognise its
requests by.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

import httpx

from client.errors import TokenIssuanceError, TokenPolicyError
from client.sending import keep_no_cookies
from ohttp.privacypass import (
    TOKEN_REQUEST_MEDIA_TYPE,
    WELL_KNOWN_PATH,
    PrivacyPassError,
    Token,
    TokenChallenge,
    TokenKey,
    begin_issuance,
    decode_directory,
    encode_authorization,
    finish_issuance,
    parse_authorization,
)
from policy import AuthorizationPolicy, Policy
from policy.shipped import resolve_policy

DEFAULT_BATCH_SIZE = 8


class TokenWallet:
    """Tokens for one gateway origin from the issuer `policy` names, under the keys it lists;
    `authorization()` gives each exactly once.

    `policy` ("strict", "dev", a file or a Policy) is the one the `Client` spending the tokens verifies
    nodes under: its `[authorization]` section names the issuer and the keys this wallet may use.
    """

    def __init__(
        self,
        issuer_url: str,
        credential: Callable[[], str],
        *,
        policy: str | Policy,
        origin: str,
        batch_size: int = DEFAULT_BATCH_SIZE,
        refill_at: int | None = None,
        http: httpx.Client | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        # Refill ahead of need: when this many are left (half a batch unless given), not when none is.
        self.refill_at = batch_size // 2 if refill_at is None else refill_at
        if not 0 <= self.refill_at < batch_size:
            raise ValueError("refill_at must be at least 0 and below batch_size")
        self.bound_to = _listed_keys(policy if isinstance(policy, Policy) else resolve_policy(policy))
        self.challenge = TokenChallenge(issuer_name=self.bound_to.issuer_name, origin_info=(origin,))
        self.batch_size = batch_size
        self._issuer_url = issuer_url
        self._credential = credential  # called for a fresh account JWT before each batch
        self._http = keep_no_cookies(http or httpx.Client(timeout=30.0, trust_env=False))
        self._tokens: deque[Token] = deque()
        self._changed = threading.Condition()  # guards _tokens, _refilling and _failure; held only briefly
        self._refilling = False
        self._failure: TokenIssuanceError | None = None

    def authorization(self) -> str:
        """An `Authorization` value carrying a token never handed out before.

        Waits only when the wallet is empty, for the refill under way; raises TokenIssuanceError if it failed.
        """
        with self._changed:
            while not self._tokens:
                if self._failure is not None:
                    failure, self._failure = self._failure, None
                    raise failure
                self._start_refill()
                self._changed.wait()
            token = self._tokens.popleft()
            if len(self._tokens) <= self.refill_at:
                self._start_refill()
        return encode_authorization(token)

    def give_back(self, authorization: str) -> None:
        """Keep a token the gateway gave back unspent; the next request sends it."""
        with self._changed:
            self._tokens.appendleft(parse_authorization(authorization))
            self._changed.notify()

    def _start_refill(self) -> None:
        """Start one batch's refill on a background thread, unless one is under way (the lock is held)."""
        if self._refilling:
            return
        self._refilling, self._failure = True, None
        threading.Thread(target=self._refill, name="veil-token-refill", daemon=True).start()

    def _refill(self) -> None:
        """Obtain a batch outside the lock, then add it and wake the waiting."""
        tokens: list[Token] = []
        failure = None
        try:
            tokens = self._obtain(self.batch_size)
        except TokenIssuanceError as error:
            failure = error
        except Exception as error:  # noqa: BLE001 - a dead refill thread would leave waiters waiting forever
            failure = TokenIssuanceError(f"the token refill failed ({type(error).__name__})")
        with self._changed:
            self._tokens.extend(tokens)
            self._refilling, self._failure = False, failure
            self._changed.notify_all()

    def __len__(self) -> int:
        return len(self._tokens)

    def close(self) -> None:
        with self._changed:
            self._tokens.clear()
        self._http.close()

    def _obtain(self, count: int) -> list[Token]:
        token_key, request_url = self._issuer_key()
        headers = {"content-type": TOKEN_REQUEST_MEDIA_TYPE, "authorization": f"Bearer {self._credential()}"}
        tokens = []
        for _ in range(count):
            pending = begin_issuance(token_key, self.challenge)
            answer = self._post(request_url, pending.request.encode(), headers)
            try:
                tokens.append(finish_issuance(pending, answer))
            except PrivacyPassError:
                raise TokenIssuanceError("the issuer's answer does not verify under its published key") from None
        return tokens

    def _issuer_key(self) -> tuple[TokenKey, str]:
        """The issuer's current key among those the policy lists, and where to send requests."""
        try:
            response = self._http.get(urljoin(self._issuer_url, WELL_KNOWN_PATH))
            response.raise_for_status()
            directory = decode_directory(response.content)
        except (httpx.HTTPError, PrivacyPassError) as error:
            raise TokenIssuanceError(f"cannot read the issuer's directory ({type(error).__name__})") from None
        usable = [key.token_key for key in directory.usable_keys(time.time())
                  if key.token_key.key_id.hex() in self.bound_to.issuer_keys]
        if not usable:
            raise TokenIssuanceError("the issuer publishes no current key that the policy lists; "
                                     "update the policy or the issuer")
        # Requests go to the issuer this client was configured with, at the path its directory names.
        return usable[0], urljoin(self._issuer_url, urlsplit(directory.request_uri).path)

    def _post(self, url: str, body: bytes, headers: dict[str, str]) -> bytes:
        try:
            response = self._http.post(url, content=body, headers=headers)
        except httpx.HTTPError as error:
            raise TokenIssuanceError(f"the issuer could not be reached ({type(error).__name__})") from None
        if response.status_code != 200:
            raise TokenIssuanceError(f"the issuer refused the token request (HTTP {response.status_code}); "
                                     "check the account credential and its quota")
        return response.content


def _listed_keys(policy: Policy) -> AuthorizationPolicy:
    """The policy's `[authorization]` section, which must list the keys tokens may be taken under."""
    if not policy.authorization.issuer_keys:
        raise TokenPolicyError(f"policy {policy.name!r} lists no issuer key, so no token may be taken under any; "
                               "list the issuer's keys in its [authorization] section, or use no wallet")
    return policy.authorization


def bound_wallet(tokens: TokenWallet | None, policy: Policy) -> TokenWallet | None:
    """`tokens`, if it is bound to the issuer and keys `policy` lists (a `Client`'s check of its wallet)."""
    if tokens is not None and tokens.bound_to != policy.authorization:
        raise TokenPolicyError(f"the token wallet is bound to other issuer keys than policy {policy.name!r} "
                               "lists; make the wallet with the policy the client verifies under")
    return tokens
