"""`Client`: attested, end-to-end encrypted inference through a Veil gateway, shaped like OpenAI's SDK.

    client = Client("http://127.0.0.1:8000", policy="dev")
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    for chunk in client.chat.completions.create(model="tiny", messages=..., stream=True): ...

Per request (ARCHITECTURE.md, "The path of one request"): fetch the directory
(cached briefly) → draw K candidates weighted by capacity → verify each one's
evidence under the client's own policy → encapsulate the request separately
to each verified node → `POST /v1/infer` → decrypt the answer with the
context of the node the gateway names. Nothing is sent unless at least one
candidate verified, and nothing of the request is ever logged.
"""

from __future__ import annotations

import base64
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, NoReturn, TypeVar

import httpx

from attestation.binding import NONCE_SIZE
from client import wire
from client.directory import DirectoryCache, DirectoryEntry, capped, sample_candidates
from client.errors import (
    CandidateFailure,
    GatewayError,
    ModelNotFoundError,
    NodeError,
    NoVerifiedNodeError,
    ResponseIntegrityError,
    UNREACHABLE,
    StreamTruncatedError,
    VeilClientError,
)
from client.tokens import TokenWallet
from client.types import (
    CandidateRecord,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Model,
    ModelList,
    Route,
)
from client.verify import CandidateVerifier, one_per_chip
from ohttp import OHTTPError, TruncatedError
from policy import Policy
from policy.shipped import resolve_policy
from protocol import codes
from protocol.constants import INFER_PATH, NODE_ATTEST_PATH, NODE_ID_HEADER

# The gateway says so when a candidate left its pool, every tried node failed before accepting, or
# the node no longer holds the key sealed to: no node read anything, so one retry with a fresh
# directory is safe.
_RETRYABLE = {(404, codes.NO_CANDIDATE), (502, codes.NODE_FAILED), (400, codes.UNKNOWN_KEY)}
# Waits longer than this are the caller's decision: the GatewayError carries retry_after.
MAX_RETRY_AFTER_S = 30.0
# Every client presents the same user agent, so it tells the gateway nothing about its user.
_USER_AGENT = "veil-client/1"

T = TypeVar("T")


class Stream(Generic[T]):
    """An iterator over streamed chunks; `route` says which node serves it and what was verified."""

    def __init__(self, chunks: Iterator[T], route: Route, close: Callable[[], None]) -> None:
        self._chunks = chunks
        self.route = route
        self._close = close

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        return next(self._chunks)

    def close(self) -> None:
        """Stop reading and release the connection."""
        self._close()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """Talks to one gateway; verifies nodes itself under `policy` ("strict", "dev", a file or a Policy).

    The default is `strict`: `dev` accepts simulated evidence and any code, so it must be asked for.
    `candidates` (K, the nodes each request is encrypted to) defaults to the policy's
    `routing.candidates`, which is also the most allowed: the gateway chooses among the candidates,
    so fewer of them leave it less choice (down to none with 1) and more would give it more.
    `timeout` bounds connecting to the gateway and each of its short answers; `answer_timeout_s` bounds
    the wait for more of an inference answer once sent (a whole answer's body comes only when its
    generation ends; None waits as long as the node works).
    `tokens` supplies a Privacy Pass token for each request attempt, for a gateway whose policy demands them.
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
        # request is sent again (freshly sealed) after that delay, at most this many times.
        self.max_retries = max_retries
        # A node sends its answer's head when it accepts a request, and a whole answer's body only when
        # generation ends: waiting for it is bounded by how long generation may take, not `timeout`.
        self._answer_timeout = httpx.Timeout(timeout, read=answer_timeout_s)
        self._http = http or httpx.Client(
            base_url=gateway_url, timeout=timeout, headers={"user-agent": _USER_AGENT},
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )
        # Privacy Pass tokens for a gateway whose policy demands them; one per request attempt.
        self._tokens = tokens
        self._directory = DirectoryCache(self._http, directory_ttl_s)
        self._verifier = CandidateVerifier(self.policy)
        self._route_lock = threading.Lock()
        self.last_route: Route | None = None
        # How far the nodes' clocks are ahead of this computer's, once a node has refused our Date.
        self._clock_skew_s = 0.0
        self.chat = _Chat(self)
        self.completions = _Completions(self)
        self.models = _Models(self)

    # ----- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- one request ----------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[Any, Route]:
        """Send one inner request and return the node's decrypted JSON answer with its route."""
        return self._with_clock_retry(lambda: self._request_once(method, path, body))

    def stream(self, path: str, body: dict[str, Any]) -> tuple[Iterator[Any], Route, Callable[[], None]]:
        """Send one streamed inner request; return an iterator of event payloads, the route and a closer.

        It returns once the node's answer has begun, so a refusal (an unknown model, bad parameters)
        raises NodeError here, as OpenAI's SDK raises on an error status, not in the middle of iteration.
        """
        return self._with_clock_retry(lambda: self._stream_once(path, body))

    def _with_clock_retry(self, send: Callable[[], T]) -> T:
        """Sends; if the node refused this computer's clock, sends once more on the node's time."""
        try:
            return send()
        except NodeError as error:
            if error.code != codes.DATE_OUT_OF_WINDOW or error.node_time is None:
                raise
            # RFC 9458 section 6.5: a client may correct its clock from the gateway resource's Date.
            self._clock_skew_s = error.node_time - time.time()
            return send()

    def _request_once(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[Any, Route]:
        target, response, route = self._send(method, path, body, streaming=False)
        try:
            inner = target.open_whole(response.read())
        except (OHTTPError, httpx.TransportError):
            # A whole answer that does not authenticate was cut (the node failed after its first
            # byte) or altered; either way its authenticated end never arrived.
            raise StreamTruncatedError(target.node_id) from None
        finally:
            response.close()
        if inner.status != 200:
            raise NodeError(inner.status, wire.error_code(inner.content), target.node_id, inner.node_time())
        try:
            return inner.json(), self._record(route, target.node_id)
        except ValueError:
            raise ResponseIntegrityError(target.node_id, "the node's answer is not JSON") from None

    def _stream_once(self, path: str, body: dict[str, Any]) -> tuple[Iterator[Any], Route, Callable[[], None]]:
        target, response, route = self._send("POST", path, body, streaming=True)
        answer = _StreamedAnswer(response, target)
        if not answer.read_head():
            answer.raise_refusal()
        return answer.events(), self._record(route, target.node_id), response.close

    def _send(
        self, method: str, path: str, body: dict[str, Any] | None, streaming: bool
    ) -> tuple[wire.SealedRequest, httpx.Response, Route]:
        """Seal and post; when the gateway is overloaded, wait its Retry-After and send again."""
        retries = 0
        while True:
            try:
                return self._send_once(method, path, body, streaming)
            except GatewayError as error:
                wait = error.retry_after
                if error.status != 503 or wait is None or wait > MAX_RETRY_AFTER_S or retries >= self.max_retries:
                    raise
                retries += 1
                time.sleep(wait)

    def _send_once(
        self, method: str, path: str, body: dict[str, Any] | None, streaming: bool
    ) -> tuple[wire.SealedRequest, httpx.Response, Route]:
        """Seal to verified candidates and post; one retry when the gateway says nothing was read."""
        for attempt in (0, 1):
            sealed, route = self._prepare(method, path, body, streaming)
            response = self._post(sealed)
            if response.is_success or not self._should_retry(response, attempt):
                break
        if not response.is_success:
            self._raise_for_gateway(response)
        try:
            return _served(sealed, response), response, route
        except VeilClientError:
            response.close()
            raise

    def _prepare(
        self, method: str, path: str, body: dict[str, Any] | None, streaming: bool
    ) -> tuple[list[wire.SealedRequest], Route]:
        directory = self._directory.get()
        check = self._fresh_record if self.fresh_evidence else self._verifier.check
        entries = capped(directory.entries, self.policy.routing.max_node_capacity)
        records = one_per_chip([check(entry) for entry in sample_candidates(entries, self.candidates)])
        route = Route(None, tuple(records), self.policy.name)
        verified = [record for record in records if record.ok]
        if not verified:
            raise _nothing_verified(records)
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

    def _post(self, sealed: Sequence[wire.SealedRequest]) -> httpx.Response:
        """POST the candidates; the answer's body is left to read (it may be a stream)."""
        payload = {"candidates": [
            {"node_id": s.node_id, "media_type": s.media_type, "encapsulated": base64.b64encode(s.encapsulated).decode()}
            for s in sealed
        ]}
        headers = {"authorization": self._tokens.authorization()} if self._tokens is not None else None
        try:
            request = self._http.build_request("POST", INFER_PATH, json=payload, headers=headers,
                                               timeout=self._answer_timeout)
            return self._http.send(request, stream=True)
        except httpx.HTTPError as error:
            raise GatewayError(UNREACHABLE, "unreachable", f"the request could not be sent ({type(error).__name__}); "
                               "check that the gateway runs and send again") from None

    def _should_retry(self, response: httpx.Response, attempt: int) -> bool:
        if attempt > 0 or (response.status_code, _gateway_code(response)) not in _RETRYABLE:
            return False
        response.close()
        self._directory.invalidate()
        return True

    def _raise_for_gateway(self, response: httpx.Response) -> None:
        try:
            code = _gateway_code(response)
        finally:
            response.close()
        retry_after = _retry_after(response)
        hint = f"retry after {retry_after:g} s" if retry_after is not None else wire.gateway_advice(code)
        raise GatewayError(response.status_code, code, f"the request was not served; {hint}", retry_after)

    def _record(self, route: Route, node_id: str) -> Route:
        served = Route(node_id, route.candidates, route.policy_name)
        with self._route_lock:
            self.last_route = served
        return served


def _candidate_count(requested: int | None, policy: Policy) -> int:
    """K: the policy's `routing.candidates`, or fewer when the caller asks for fewer."""
    most = policy.routing.candidates
    if requested is None:
        return most
    if not 1 <= requested <= most:
        raise ValueError(f"candidates must be between 1 and {most}, the most policy {policy.name!r} allows: "
                         "the gateway chooses among the candidates, so more would give it more choice")
    return requested


def _served(sealed: Sequence[wire.SealedRequest], response: httpx.Response) -> wire.SealedRequest:
    """The candidate the gateway chose, by the node id it names; only ours can be decrypted anyway."""
    node_id = response.headers.get(NODE_ID_HEADER, "")
    for candidate in sealed:
        if candidate.node_id == node_id:
            return candidate
    raise ResponseIntegrityError(None, "the gateway names a node this request was not encrypted to")


class _StreamedAnswer:
    """A chunked answer being read: its head first, then its events; the connection closes at the end."""

    def __init__(self, response: httpx.Response, target: wire.SealedRequest) -> None:
        self._response = response
        self._node_id = target.node_id
        self._decoder = target.stream_decoder()
        self._pieces = response.iter_raw()
        self._early: list[Any] = []  # events that arrived in the same pieces as the head

    def read_head(self) -> bool:
        """Reads until the node's status is known; True if it is 200."""
        with self._errors_translated(close=True):
            while self._decoder.status is None:
                piece = next(self._pieces, None)
                if piece is None:
                    break  # a stream cut before its head; events() reports the truncation
                self._early += self._decoder.feed(piece)
        return self._decoder.status == 200

    def raise_refusal(self) -> NoReturn:
        """Reads the rest of an answer whose status is not 200 and raises what it says."""
        for _ in self.events():  # an error body carries no events; the end raises NodeError
            pass
        raise ResponseIntegrityError(self._node_id, "the node refused without saying why")

    def events(self) -> Iterator[Any]:
        try:
            with self._errors_translated(close=False):
                yield from self._early
                self._early = []
                for piece in self._pieces:
                    yield from self._decoder.feed(piece)
                error = self._decoder.finish()
        finally:
            self._response.close()
        if error is not None:
            raise NodeError(error.status, wire.error_code(error.content), self._node_id, error.node_time())
        if not self._decoder.done:
            raise StreamTruncatedError(self._node_id, "the event stream")

    @contextlib.contextmanager
    def _errors_translated(self, close: bool) -> Iterator[None]:
        try:
            yield
        except (TruncatedError, httpx.TransportError):
            self._close_if(close)
            raise StreamTruncatedError(self._node_id) from None
        except (OHTTPError, ValueError):
            self._close_if(close)
            raise ResponseIntegrityError(self._node_id, "the node's streamed answer did not authenticate or parse") from None

    def _close_if(self, close: bool) -> None:
        if close:
            self._response.close()


def _nothing_verified(records: Sequence[CandidateRecord]) -> NoVerifiedNodeError:
    if not records:
        return NoVerifiedNodeError([], "the gateway lists no node with capacity; nothing was sent")
    failures = [CandidateFailure(r.node_id, r.failed_check or "unknown", r.failure or "") for r in records]
    return NoVerifiedNodeError(failures)


def _gateway_code(response: httpx.Response) -> str:
    try:
        if not response.is_stream_consumed:
            response.read()  # an error body: a few hundred bytes of JSON
        error = response.json().get("error")
    except (ValueError, AttributeError, httpx.HTTPError):
        return "unknown"
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else "unknown"


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


# ----- the OpenAI-shaped resources -------------------------------------------------------------


# Sampling settings beyond OpenAI's that nodes take (vLLM's names), passed as keywords to `create`.
SAMPLING_EXTRAS = ("top_k", "min_p", "stop_token_ids", "ignore_eos")


def _extras(sampling: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(sampling) - set(SAMPLING_EXTRAS))
    if unknown:
        raise TypeError(f"create() got unexpected keyword arguments {unknown}; sampling extras are {list(SAMPLING_EXTRAS)}")
    return sampling


def _body(**fields: Any) -> dict[str, Any]:
    """The request's JSON: only the parameters the caller set."""
    return {name: value for name, value in fields.items() if value is not None}


def _messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {role, content} messages")
    out = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError("each message needs a string role and string content")
        out.append({"role": role, "content": content})
    return out


def _parsed(parse: Callable[[Any], T], node_id: str | None) -> Callable[[Any], T]:
    def run(payload: Any) -> T:
        try:
            return parse(payload)
        except (ValueError, TypeError):
            raise ResponseIntegrityError(node_id, "the node's answer does not have the expected shape") from None
    return run


W = TypeVar("W")


def _create(client: Client, path: str, body: dict[str, Any], stream: bool,
            chunk: Callable[[Any], T], whole: Callable[[Any, Route], W]) -> W | Stream[T]:
    """POST `body` to `path`: a typed whole answer, or with `stream` a Stream of typed chunks."""
    if stream:
        return _stream_of(client, path, body, chunk)
    data, route = client.request("POST", path, body)
    return _parsed(lambda d: whole(d, route), route.node_id)(data)


def _stream_of(client: Client, path: str, body: dict[str, Any], parse: Callable[[Any], T]) -> Stream[T]:
    payloads, route, close = client.stream(path, body)
    typed = _parsed(parse, route.node_id)
    return Stream((typed(p) for p in payloads), route, close)


class _ChatCompletions:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(
        self,
        *,
        model: str,
        messages: Sequence[Any],
        stream: bool = False,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        stream_options: dict[str, Any] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        **sampling: Any,
    ) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """A chat answer, or with `stream=True` an iterator of `ChatCompletionChunk`.

        `stream_options={"include_usage": True}` ends a stream with a chunk without choices that
        carries the request's usage, as OpenAI does. `logprobs=True` (with `top_logprobs=N` alternatives)
        returns each token's log probability in `choices[i].logprobs`; `top_k`, `min_p`, `stop_token_ids`
        and `ignore_eos` are taken as keywords too (see `SAMPLING_EXTRAS`)."""
        body = _body(model=model, messages=_messages(messages), stream=stream, n=n, temperature=temperature,
                     top_p=top_p, max_tokens=max_tokens, stop=stop, seed=seed, stream_options=stream_options,
                     logprobs=logprobs, top_logprobs=top_logprobs, **_extras(sampling))
        return _create(self._client, "/v1/chat/completions", body, stream,
                       ChatCompletionChunk.from_dict, ChatCompletion.from_dict)


class _Chat:
    def __init__(self, client: Client) -> None:
        self.completions = _ChatCompletions(client)


class _Completions:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(
        self,
        *,
        model: str,
        prompt: str,
        stream: bool = False,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        stream_options: dict[str, Any] | None = None,
        logprobs: int | None = None,
        **sampling: Any,
    ) -> Completion | Stream[Completion]:
        """A text completion, or with `stream=True` an iterator of `Completion` pieces (`stream_options`
        and the sampling keywords as for chat; `logprobs=N` as OpenAI's text completions take it)."""
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        body = _body(model=model, prompt=prompt, stream=stream, n=n, temperature=temperature,
                     top_p=top_p, max_tokens=max_tokens, stop=stop, seed=seed, stream_options=stream_options,
                     logprobs=logprobs, **_extras(sampling))
        return _create(self._client, "/v1/completions", body, stream, Completion.from_dict, Completion.from_dict)


class _Models:
    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self) -> ModelList:
        """The models a verified node serves."""
        data, route = self._client.request("GET", "/v1/models")
        return _parsed(lambda d: ModelList.from_dict(d, route), route.node_id)(data)

    def retrieve(self, model: str) -> Model:
        """One model a verified node serves, as OpenAI's `models.retrieve`; ModelNotFoundError if none does."""
        for listed in self.list().data:
            if listed.id == model:
                return listed
        raise ModelNotFoundError()
