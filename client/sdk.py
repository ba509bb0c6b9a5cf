"""`Client`: attested, end-to-end encrypted inference through a Veil gateway, shaped like OpenAI's SDK.

    client = Client("http://127.0.0.1:8000", policy="dev")
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    for chunk in client.chat.completions.create(model="tiny", messages=..., stream=True): ...

Per request (ARCHITECTURE.md, "The path of one request"): fetch the directory
(cached briefly) → draw K candidates weighted by capacity → verify each one's
evidence under the client's own policy → encapsulate the request separately
to each verified node → `POST /v1/infer` → decrypt the answer with the
context of the node the gateway names → verify the node's signed receipt for
it (`client.receipts`). Nothing is sent unless at least one candidate verified,
no answer is taken without its receipt, and nothing of the request is ever logged.

This module holds `Client`: its configuration, the directory and verification, and the two entry
points every resource goes through (`request`, `stream`). Around it: `client.resources` (the
OpenAI-shaped surface), `client.retries` (when a request is sent again, and why), `client.sending`
(one post to the gateway and its refusals) and `client.streaming` (reading a streamed answer).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import httpx

from attestation.binding import NONCE_SIZE
from attestation.receipts import Receipt
from client import wire
from client.directory import (DirectoryCache, DirectoryEntry, capped, listed_models, model_pool, request_task,
                              sample_candidates)
from client.embeddings import Embeddings
from client.errors import (
    CandidateFailure,
    NodeError,
    NoVerifiedNodeError,
    ResponseIntegrityError,
    StreamTruncatedError,
    VeilClientError,
)
from client.receipts import ReceiptCheck
from client.resources import SAMPLING_EXTRAS, Chat, Completions, Models, Responses
from client.retries import MAX_RETRY_AFTER_S, send_with_retries
from client.sending import gateway_refusal, keep_no_cookies, post_candidates, served, token_given_back
from client.streaming import Stream, StreamedAnswer
from client.tokens import TokenWallet, bound_wallet
from client.types import CandidateRecord, Route
from client.verify import CandidateVerifier, one_per_chip
from ohttp import OHTTPError
from policy import Policy
from policy.shipped import resolve_policy
from protocol.constants import NODE_ATTEST_PATH

# What callers import from here: `Client`, and the names its API hands back or is bounded by.
__all__ = ["MAX_RETRY_AFTER_S", "SAMPLING_EXTRAS", "Client", "Stream"]

# Every client presents the same user agent, so it tells the gateway nothing about its user.
_USER_AGENT = "veil-client/1"

T = TypeVar("T")


class Client:
    """Talks to one gateway; verifies nodes itself under `policy` ("strict", "dev", a file or a Policy).

    The default is `strict`: `dev` accepts simulated evidence and any code, so it must be asked for.
    `candidates` (K, the nodes each request is encrypted to) defaults to the policy's
    `routing.candidates`, which is also the most allowed: the gateway chooses among the candidates,
    so fewer of them leave it less choice (down to none with 1) and more would give it more.
    `timeout` bounds connecting to the gateway and each of its short answers; `answer_timeout_s` bounds
    the wait for more of an inference answer once sent (a whole answer's body comes only when its
    generation ends; None waits as long as the node works).
    `tokens` supplies a Privacy Pass token for each request attempt, for a gateway whose policy demands them;
    it must be bound to the same policy (`TokenWallet(..., policy=...)`), else `TokenPolicyError`.
    """

    def __init__(
        self,
        gateway_url: str,
        *,
        policy: str | Policy = "strict",
        candidates: int | None = None,
        timeout: float = 60.0,
        answer_timeout_s: float | None = 600.0,
        directory_ttl_s: float = 10.0,
        fresh_evidence: bool = False,
        max_retries: int = 2,
        http: httpx.Client | None = None,
        tokens: TokenWallet | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must not be negative")
        self.policy = policy if isinstance(policy, Policy) else resolve_policy(policy)
        self.candidates = _candidate_count(candidates, self.policy)
        # Ask each candidate for evidence over a nonce of the client's own, on every request, instead of
        # trusting the freshness of the evidence the gateway obtained at admission.
        self.fresh_evidence = fresh_evidence
        # A gateway at its bounds answers 503 with Retry-After before any node read anything; the
        # request is sent again (freshly sealed) after that delay, at most this many times
        # (`client.retries` lists every retry and its bound).
        self.max_retries = max_retries
        # A node sends its answer's head when it accepts a request, and a whole answer's body only when
        # generation ends: waiting for it is bounded by how long generation may take, not `timeout`.
        self._answer_timeout = httpx.Timeout(timeout, read=answer_timeout_s)
        self._http = keep_no_cookies(http or httpx.Client(
            base_url=gateway_url, timeout=timeout, headers={"user-agent": _USER_AGENT},
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        ))
        # Privacy Pass tokens for a gateway whose policy demands them; one per request attempt, only under
        # the issuer keys this client's policy lists.
        self._tokens = bound_wallet(tokens, self.policy)
        self._directory = DirectoryCache(self._http, directory_ttl_s)
        self._verifier = CandidateVerifier(self.policy)
        self._route_lock = threading.Lock()
        self.last_route: Route | None = None
        # How far the nodes' clocks are ahead of this computer's, once a node has refused our Date.
        self._clock_skew_s = 0.0
        self.chat = Chat(self)
        self.completions = Completions(self)
        self.responses = Responses(self)
        self.embeddings = Embeddings(self)
        self.models = Models(self)

    # ----- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- one request ----------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                model: str | None = None) -> tuple[Any, Route]:
        """Send one inner request and return the node's decrypted JSON answer with its route.

        It goes to nodes serving the body's `model`, or `model` for a request without one (a listing)."""
        return self._with_retries(lambda: self._request_once(method, path, body, model))

    def listed_models(self) -> list[str]:
        """Every model name the directory lists (the gateway's word: each node's own listing is the truth)."""
        return listed_models(self._directory.get().entries)

    def stream(self, path: str, body: dict[str, Any]) -> tuple[Iterator[Any], Route, StreamedAnswer]:
        """Send one streamed inner request; return an iterator of event payloads, the route and the answer
        (which closes it, and holds its verified receipt once the iterator has ended).

        It returns once the node's answer has begun, so a refusal (an unknown model, bad parameters)
        raises NodeError here, as OpenAI's SDK raises on an error status, not in the middle of iteration.
        """
        return self._with_retries(lambda: self._stream_once(path, body))

    def _with_retries(self, send: Callable[[], T]) -> T:
        """`send()`, sent again as `client.retries` allows (its docstring lists every retry and its bound)."""
        return send_with_retries(send, self.max_retries, correct_clock=self._correct_clock,
                                 refetch_directory=self._directory.invalidate)

    def _request_once(self, method: str, path: str, body: dict[str, Any] | None,
                      model: str | None = None) -> tuple[Any, Route]:
        target, response, route = self._send(method, path, body, streaming=False, model=model)
        try:
            inner = target.open_whole(response.read())
        except (OHTTPError, httpx.TransportError):
            # A whole answer that does not authenticate was cut (the node failed after its first
            # byte) or altered; either way its authenticated end never arrived.
            raise StreamTruncatedError(target.node_id) from None
        finally:
            response.close()
        if inner.status != 200:
            raise NodeError.from_body(inner.status, inner.content, target.node_id, inner.node_time())
        check = self._receipt_check(target, route)
        receipt = check.verify(inner.trailers, hashlib.sha256(inner.content).digest(), inner.status)
        try:
            return inner.json(), self._record(route, target.node_id, receipt)
        except ValueError:
            raise ResponseIntegrityError(target.node_id, "the node's answer is not JSON") from None

    def _stream_once(self, path: str, body: dict[str, Any]) -> tuple[Iterator[Any], Route, StreamedAnswer]:
        target, response, route = self._send("POST", path, body, streaming=True)
        answer = StreamedAnswer(response, target, self._receipt_check(target, route))
        if not answer.read_head():
            answer.raise_refusal()
        return answer.events(), self._record(route, target.node_id), answer

    def _send(
        self, method: str, path: str, body: dict[str, Any] | None, streaming: bool, model: str | None = None
    ) -> tuple[wire.SealedRequest, httpx.Response, Route]:
        """Seal to verified candidates and post once; the chosen candidate and the gateway's open response."""
        sealed, route = self._prepare(method, path, body, streaming, model)
        authorization = self._tokens.authorization() if self._tokens is not None else None
        response = post_candidates(self._http, sealed, authorization, self._answer_timeout)
        if not response.is_success:
            refusal = gateway_refusal(response)
            if authorization is not None and token_given_back(refusal):
                self._tokens.give_back(authorization)  # unspent: the next attempt sends it again
            raise refusal
        try:
            return served(sealed, response), response, route
        except VeilClientError:
            response.close()
            raise

    def _prepare(
        self, method: str, path: str, body: dict[str, Any] | None, streaming: bool, model: str | None = None
    ) -> tuple[list[wire.SealedRequest], Route]:
        """Verify candidates drawn from the directory and seal the request to each that verified.

        Candidates are drawn among the nodes serving the request's model for its task only (`model_pool`).
        Nothing is sealed, so nothing can be sent, unless at least one candidate verified."""
        directory = self._directory.get()
        check = self._fresh_record if self.fresh_evidence else self._verifier.check
        wanted = (body or {}).get("model", model)
        pool = model_pool(directory.entries, wanted if isinstance(wanted, str) else None, request_task(method, path))
        entries = capped(pool, self.policy.routing.max_node_capacity)
        checked = [check(entry) for entry in sample_candidates(entries, self.candidates)]
        records = one_per_chip(self._verifier.transparency.refuse_if_forked(checked))
        route = Route(None, tuple(records), self.policy.name)
        verified = [record for record in records if record.ok]
        if not verified:
            raise _nothing_verified(records, self._verifier.transparency.fork())
        inner = wire.build_request(method, path, body, now=time.time() + self._clock_skew_s)
        sealed = [wire.seal(r.node_id, r.verified.key_config, inner, streaming) for r in verified]
        return sealed, route

    def _fresh_record(self, entry: DirectoryEntry) -> CandidateRecord:
        nonce = os.urandom(NONCE_SIZE)
        try:
            response = self._http.post(NODE_ATTEST_PATH.format(node_id=entry.node_id), json={"nonce": nonce.hex()})
            evidence = response.json().get("evidence") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            evidence = None
        if not isinstance(evidence, str):
            return CandidateRecord(entry.node_id, entry.capacity, None, "fresh evidence",
                                   "the node's evidence over this client's nonce could not be obtained")
        return self._verifier.check_fresh(entry, evidence, nonce)

    def _correct_clock(self, node_time: float) -> None:
        """Take the node's clock as right from now on (RFC 9458 section 6.5: from its Date)."""
        self._clock_skew_s = node_time - time.time()

    def _receipt_check(self, target: wire.SealedRequest, route: Route) -> ReceiptCheck:
        """What the answer's receipt must prove: `target` was sealed to a verified candidate of `route`."""
        node = next(r.verified for r in route.candidates if r.node_id == target.node_id and r.verified is not None)
        return ReceiptCheck(target.request, node, self.policy.attestation.max_clock_skew_s,
                            lambda: time.time() + self._clock_skew_s)

    def _record(self, route: Route, node_id: str, receipt: Receipt | None = None) -> Route:
        served_route = Route(node_id, route.candidates, route.policy_name, receipt)
        with self._route_lock:
            self.last_route = served_route
        return served_route


def _candidate_count(requested: int | None, policy: Policy) -> int:
    """K: the policy's `routing.candidates`, or fewer when the caller asks for fewer."""
    most = policy.routing.candidates
    if requested is None:
        return most
    if not 1 <= requested <= most:
        raise ValueError(f"candidates must be between 1 and {most}, the most policy {policy.name!r} allows: "
                         "the gateway chooses among the candidates, so more would give it more choice")
    return requested


def _nothing_verified(records: Sequence[CandidateRecord], fork: Exception | None = None) -> NoVerifiedNodeError:
    if not records:
        return NoVerifiedNodeError([], "the gateway lists no node with capacity; nothing was sent")
    failures = [CandidateFailure(r.node_id, r.failed_check or "unknown", r.failure or "") for r in records]
    return NoVerifiedNodeError(failures, None if fork is None else f"{fork}; nothing was sent")
