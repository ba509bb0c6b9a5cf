"""`veil relay`: an Oblivious Relay Resource (RFC 9458 section 4) in front of one Veil gateway.

Run by a party other than the gateway's operator, the relay keeps client
addresses from the gateway: the gateway sees only the relay's connections,
shared by all of its clients. The relay sees client addresses, and the sizes
and timing of ciphertexts, never a plaintext.

What it forwards, and nothing else (every other path is 404):

- `GET /v1/nodes`, the directory. It is the same for every caller, so fetching
  it through the relay hides nothing new, and a client never has to connect
  to the gateway directly.
- `POST /v1/infer`, the JSON body of a client's sealed candidates.
- `POST /v1/nodes/{node_id}/ohttp`, a standard (`message/ohttp-req`) or
  chunked (`message/ohttp-chunked-req`) OHTTP request.
- `POST /v1/nodes/{node_id}/attest`, a client's nonce asking a node for fresh
  evidence.

Of a request it forwards the body, a media type it sets itself
(`application/json`, or the OHTTP media type it checked) and a Privacy Pass
`Authorization: PrivateToken` credential, which RFC 9576 makes unlinkable to
the client that redeems it: no other client header, no client address, and
nothing added (no `Forwarded`, `X-Forwarded-For`, `Via`, user agent, nor a
cookie: it keeps no cookie, nor anything else, between requests). Of an
answer it passes the gateway's status, its body as it arrives (a chunked
OHTTP answer is forwarded incrementally, never buffered, RFC 9842) and only
`FORWARDED_RESPONSE_HEADERS` (never `Set-Cookie`). Bodies are bounded (413
above `max_body_bytes`) and so are requests in flight (503 with
`Retry-After` at the bound); it serves with the gateway's uvicorn settings: no
access log, no server header, deadlines for a request's head and body. For its
operator it answers `/livez` and `/readyz` (ready while its gateway is); its
`/metrics` (requests by route and status class, requests in flight: no address)
are served only on a listener of their own (`metrics_listen`, off by default),
never on the port that faces clients.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from fastapi import Depends, FastAPI, Path as PathParameter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from audit.metrics import Metrics, MetricsServer, serve_metrics
from protocol.constants import (
    DIRECTORY_PATH,
    INFER_PATH,
    MAX_ENCAPSULATED_BYTES,
    NODE_ATTEST_PATH,
    NODE_ID_HEADER,
    NODE_ID_PATTERN,
    NODE_OHTTP_PATH,
)
from relay.errors import GatewayUnreachableError
from serving.backpressure import InFlightLimiter, Permit
from serving.errors import NotFoundError, SettingsError
from serving.ohttp_requests import refuse_expectations, request_media_type
from serving.probes import READINESS_PATH, install_probes
from serving.responses import install_error_handlers, read_bounded
from serving.settings import MAX_BODY_BYTES, MAX_IN_FLIGHT, RETRY_AFTER_S, SERVER_DEFAULTS, ServerSettings

# What a client needs of an answer: how to read it, whether it comes incrementally, when to retry,
# which node answered (the SDK decrypts with that node's context), that it is not to be cached, and
# which Privacy Pass token the gateway asks for.
FORWARDED_RESPONSE_HEADERS = ("content-type", "incremental", "retry-after", NODE_ID_HEADER, "cache-control",
                              "www-authenticate")
# A Privacy Pass token (RFC 9577) is unlinkable to its client by design; it is the one client header passed on.
TOKEN_SCHEME = "privatetoken "
MAX_TOKEN_HEADER_BYTES = 4096
_JSON = "application/json"
_NODE_ID = re.compile(NODE_ID_PATTERN, re.ASCII)
_UNREACHABLE = "the relay could not reach the gateway; retry later"
PROBE_TIMEOUT_S = 2.0
_log = logging.getLogger("veil.relay")


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """Everything `create_relay_app` needs; the serving bounds are every Veil server's defaults."""

    gateway_url: str
    listen: str = "127.0.0.1:0"
    port_file: Path | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_in_flight: int = MAX_IN_FLIGHT
    retry_after_s: int = RETRY_AFTER_S
    connect_timeout_s: float = 10.0
    # How long the gateway may pause within an answer (a whole answer's body comes when generation ends).
    answer_timeout_s: float = 600.0
    header_timeout_s: float = SERVER_DEFAULTS.header_timeout_s
    body_timeout_s: float = SERVER_DEFAULTS.body_timeout_s
    keep_alive_s: float = SERVER_DEFAULTS.keep_alive_s
    max_connections: int = SERVER_DEFAULTS.max_connections
    # HOST:PORT of the operator's `/metrics` listener, apart from the public port (None: no metrics served).
    metrics_listen: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.gateway_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise SettingsError("the gateway URL must look like https://HOST[:PORT] (http:// on loopback)")
        for name in ("max_body_bytes", "max_in_flight", "retry_after_s"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be at least 1")
        for name in ("connect_timeout_s", "answer_timeout_s"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be a positive number of seconds")
        self.serving()  # the listen address and the serving bounds are checked as every server checks its own

    def serving(self) -> ServerSettings:
        """The settings `serving.server` serves with: the listen address, port file and connection bounds."""
        return ServerSettings(listen=self.listen, port_file=self.port_file, header_timeout_s=self.header_timeout_s,
                              body_timeout_s=self.body_timeout_s, keep_alive_s=self.keep_alive_s,
                              max_connections=self.max_connections)


class Upstream:
    """The relay's connections to the gateway, and the bound on requests in flight through them."""

    def __init__(self, settings: RelaySettings) -> None:
        self.limiter = InFlightLimiter(settings.max_in_flight, settings.max_in_flight, settings.retry_after_s)
        self._http = _gateway_client(settings)
        self.metrics = Metrics()
        self.metrics.gauge("veil_relay_in_flight", lambda: self.limiter.in_flight)
        self._requests = self.metrics.counter("veil_relay_requests")

    async def forward(self, request: Request, route: str, path: str, media_type: str | None,
                      max_bytes: int) -> Response:
        """Send `path` the request's bounded body (POST) or nothing (GET); the gateway's streamed answer.

        `route` is the fixed name of the relay's route, the one label its metrics give a request."""
        permit = self.limiter.admit_request()
        try:
            body = await read_bounded(request, max_bytes) if media_type else None
            headers = {"content-type": media_type, **_token_credential(request)} if media_type else None
            outgoing = self._http.build_request(request.method, path, content=body, headers=headers)
            answer = await self._http.send(outgoing, stream=True)
        except httpx.HTTPError:
            permit.release()
            self._requests.labels(route, "unreachable").inc()
            raise GatewayUnreachableError(_UNREACHABLE) from None
        except BaseException:
            permit.release()
            raise
        self._requests.labels(route, f"{answer.status_code // 100}xx").inc()
        return ForwardedAnswer(answer, permit)

    async def gateway_ready(self) -> bool:
        """Whether the gateway answers its readiness probe (a fixed GET that carries nothing of a client)."""
        try:
            answer = await self._http.get(READINESS_PATH, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return answer.status_code == 200

    async def close(self) -> None:
        await self._http.aclose()


def _token_credential(request: Request) -> dict[str, str]:
    """The request's one PrivateToken credential, or nothing (other schemes could name the client)."""
    values = request.headers.getlist("authorization")
    if len(values) != 1 or len(values[0]) > MAX_TOKEN_HEADER_BYTES or not values[0].lower().startswith(TOKEN_SCHEME):
        return {}
    return {"authorization": values[0]}


def _gateway_client(settings: RelaySettings) -> httpx.AsyncClient:
    timeout = httpx.Timeout(settings.connect_timeout_s, read=settings.answer_timeout_s)
    limits = httpx.Limits(max_connections=settings.max_in_flight, max_keepalive_connections=settings.max_in_flight)
    # A jar that refuses every cookie: one the gateway set on an answer would otherwise go back with every
    # later request, whichever client sent it (a tag linking clients), and the jar would grow without bound.
    no_cookies = CookieJar(DefaultCookiePolicy(allowed_domains=()))
    http = httpx.AsyncClient(base_url=settings.gateway_url.rstrip("/"), timeout=timeout, limits=limits,
                             trust_env=False, follow_redirects=False, cookies=no_cookies)
    # httpx sends Accept, Accept-Encoding, Connection and User-Agent by default; the relay adds nothing.
    for name in list(http.headers):
        del http.headers[name]
    return http


class ForwardedAnswer(StreamingResponse):
    """The gateway's answer, passed on as it arrives; the slot and the gateway's answer are closed at the end."""

    def __init__(self, answer: httpx.Response, permit: Permit) -> None:
        headers = {name: answer.headers[name] for name in FORWARDED_RESPONSE_HEADERS if name in answer.headers}
        super().__init__(_passed_on(answer), status_code=answer.status_code, headers=headers)
        self._answer = answer
        self._permit = permit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._answer.aclose()
            self._permit.release()


async def _passed_on(answer: httpx.Response) -> AsyncIterator[bytes]:
    """The answer's bytes as they come, as sent (never decoded); losing the gateway ends the stream early,
    which the client's decryption reports as a truncated answer."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.HTTPError:
        return


def create_relay_app(settings: RelaySettings) -> FastAPI:
    """The relay application for `settings`."""
    upstream = Upstream(settings)
    metrics_server = _metrics_server(upstream.metrics, settings.metrics_listen)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await upstream.close()
            if metrics_server is not None:
                metrics_server.close()

    app = FastAPI(title="Veil relay", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.upstream = upstream
    app.state.metrics_server = metrics_server
    install_error_handlers(app)
    _install_routes(app, upstream, settings.max_body_bytes)
    # Ready while its gateway is: a relay in front of a gateway with no node can forward nothing useful.
    install_probes(app, upstream.gateway_ready)
    return app


def _metrics_server(metrics: Metrics, listen: str | None) -> MetricsServer | None:
    """The operator's `/metrics` listener, bound now so that a taken address fails the start."""
    if listen is None:
        return None
    try:
        return serve_metrics(metrics, listen)
    except OSError as error:
        raise SettingsError(str(error)) from None


def _install_routes(app: FastAPI, upstream: Upstream, max_body_bytes: int) -> None:
    @app.get(DIRECTORY_PATH)
    async def directory(request: Request) -> Response:
        return await upstream.forward(request, "directory", DIRECTORY_PATH, None, 0)

    @app.post(INFER_PATH, dependencies=[Depends(refuse_expectations)])
    async def infer(request: Request) -> Response:
        return await upstream.forward(request, "infer", INFER_PATH, _JSON, max_body_bytes)

    @app.post(NODE_OHTTP_PATH, dependencies=[Depends(refuse_expectations)])
    async def ohttp(request: Request, node_id: str = PathParameter(max_length=64)) -> Response:
        media_type = request_media_type(request)
        limit = min(max_body_bytes, MAX_ENCAPSULATED_BYTES)
        return await upstream.forward(request, "ohttp", NODE_OHTTP_PATH.format(node_id=_checked(node_id)), media_type,
                                      limit)

    @app.post(NODE_ATTEST_PATH)
    async def attest(request: Request, node_id: str = PathParameter(max_length=64)) -> Response:
        return await upstream.forward(request, "attest", NODE_ATTEST_PATH.format(node_id=_checked(node_id)), _JSON,
                                      1024)


def _checked(node_id: str) -> str:
    """`node_id` if it is one (so that no client text but a node id ever reaches the gateway's path)."""
    if _NODE_ID.fullmatch(node_id) is None:
        raise NotFoundError("that path does not name a node; fetch /v1/nodes")
    return node_id


def serve_relay(settings: RelaySettings) -> int:
    """Run the relay until SIGINT/SIGTERM (exit status 0)."""
    from serving.server import serve_app

    app = create_relay_app(settings)
    if app.state.metrics_server is not None:
        host = settings.metrics_listen.rpartition(":")[0]
        _log.info("veil relay: metrics on %s:%s", host, app.state.metrics_server.port)
    return serve_app(app, settings.serving(), name="veil relay")

