"""Privacy Pass tokens for the gateway: obtained blindly from the issuer in batches, each spent once.

The wallet asks the issuer to sign blinded token requests (RFC 9578 type 2),
so the issuer learns the account and the number of tokens but never the
tokens themselves; each answer is unblinded and verified under the issuer's
published key before it is kept. Tokens are bound to the gateway's origin
and the issuer named in the client's policy, kept in memory only, and handed
out one per request attempt, never twice: a retried request takes a new one.

When the policy lists issuer keys the wallet uses only a listed key, so an
issuer cannot give this client a key of its own to recognise its requests.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

import httpx

from client.errors import TokenIssuanceError
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
)

DEFAULT_BATCH_SIZE = 8


class TokenWallet:
    """Tokens for one gateway origin from one issuer; `authorization()` gives each exactly once."""

    def __init__(
        self,
        issuer_url: str,
        credential: Callable[[], str],
        *,
        issuer_name: str,
        origin: str,
        listed_key_ids: tuple[str, ...] = (),
        batch_size: int = DEFAULT_BATCH_SIZE,
        http: httpx.Client | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.challenge = TokenChallenge(issuer_name=issuer_name, origin_info=(origin,))
        self.batch_size = batch_size
        self._issuer_url = issuer_url
        self._credential = credential  # called for a fresh account JWT before each batch
        self._listed = listed_key_ids
        self._http = http or httpx.Client(timeout=30.0, trust_env=False)
        self._tokens: deque[Token] = deque()
        self._lock = threading.Lock()

    def authorization(self) -> str:
        """An `Authorization` value carrying a token never handed out before (refills when empty)."""
        with self._lock:
            if not self._tokens:
                self._tokens.extend(self._obtain(self.batch_size))
            return encode_authorization(self._tokens.popleft())

    def __len__(self) -> int:
        return len(self._tokens)

    def close(self) -> None:
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
        """The issuer's current key (one the policy lists, if it lists any) and where to send requests."""
        try:
            response = self._http.get(urljoin(self._issuer_url, WELL_KNOWN_PATH))
            response.raise_for_status()
            directory = decode_directory(response.content)
        except (httpx.HTTPError, PrivacyPassError) as error:
            raise TokenIssuanceError(f"cannot read the issuer's directory ({type(error).__name__})") from None
        usable = [key.token_key for key in directory.usable_keys(time.time())
                  if not self._listed or key.token_key.key_id.hex() in self._listed]
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
