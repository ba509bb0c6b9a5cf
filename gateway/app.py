"""The gateway's FastAPI application: directory, anonymous relay and router, nothing else.

It never decrypts, never logs a client's address, header or body, and never
lets one reach a node: handlers read only the body (and, for the raw OHTTP
route, its media type) and build the node call from that alone. Every error
is a fixed code and sentence. The directory is rendered once per pool change
and served byte for byte the same to every caller.
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Path, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from audit.metrics import Metrics, MetricsSink
from audit.sink import AuditSink, open_sink
from gateway.audit import GatewayAuditor, TokenTallyReporter
from gateway.auth import Admission, TokenGate, authorize_anonymously, token_back_unless_taken
from gateway.directory import DirectoryCache
from gateway.discovery import Resolver, resolve_addresses
from gateway.errors import NoCandidateError, NodeFailedError, NodeUnreachableError
from gateway.forwarding import Forwarder, RelayedAnswer
from gateway.keeper import PoolKeeper
from gateway.models import (
    NODE_ID_PATTERN,
    Candidate,
    Directory,
    ErrorBody,
    InferBody,
    parse_attest_body,
    parse_infer_body,
    parse_register_body,
)
from gateway.pool import NodePool
from gateway.relay_only import only_from_relays
from gateway.results import ResultSigner
from gateway.settings import GatewaySettings
from gateway.token_gate import token_gate_for
from ohttp.media_types import OHTTP_CHUNKED_RESPONSE
from policy import resolve_policy
from protocol.constants import (
    DIRECTORY_PATH,
    INFER_PATH,
    MAX_ENCAPSULATED_BYTES,
    NODE_ATTEST_PATH,
    NODE_ID_HEADER,
    NODE_OHTTP_PATH,
)
from serving.backpressure import InFlightLimiter
from serving.errors import MalformedRequestError
from serving.ohttp_requests import refuse_expectations, request_media_type
from serving.probes import install_metrics, install_probes
from serving.responses import install_error_handlers, read_bounded

_NODE_ID = re.compile(NODE_ID_PATTERN.strip("^$"), re.ASCII)
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (400, 404, 413, 417, 502, 503, 504)
}


@dataclass(slots=True)
class GatewayRuntime:
    """Everything the handlers share; one per application."""

    settings: GatewaySettings
    pool: NodePool
    keeper: PoolKeeper
    forwarder: Forwarder
    directory: DirectoryCache
    auditor: GatewayAuditor
    signer: ResultSigner
    metrics: Metrics
    token_gate: TokenGate | None = None


def create_app(
    settings: GatewaySettings,
    *,
    audit_sink: AuditSink | None = None,
    routing_rng: random.Random | None = None,
    node_resolver: Resolver = resolve_addresses,
    clock: Callable[[], float] = time.time,
) -> FastAPI:
    """The gateway application for `settings` (raises PolicyError/AuditSinkError on bad configuration).

    `audit_sink` replaces the sink named by `settings.audit`; `routing_rng`
    replaces the operating system's randomness, for seeded tests only; `node_resolver` resolves the
    --node-dns names (the system's resolver unless a test gives its own); `clock` is the time the pool
    verifies evidence at and expires it by (the system's, unless a test moves it past a node's collateral).
    """
    runtime = _build_runtime(settings, audit_sink, routing_rng, node_resolver, clock)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.keeper.start()
        tallies = None if runtime.token_gate is None else TokenTallyReporter(runtime.token_gate.decisions,
                                                                             runtime.auditor)
        if tallies is not None:
            tallies.start()
        try:
            yield
        finally:
            await runtime.keeper.stop()
            if tallies is not None:
                await tallies.stop()
            runtime.auditor.close()

    # No API documentation, as on the relay, issuer and proxy: FastAPI's /docs and /redoc pages load
    # their scripts from a public CDN, telling a third party who looks at this gateway, and a schema
    # without its page is half a feature. The README lists the routes; `app.openapi()` still gives the schema.
    app = FastAPI(title="Veil gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.runtime = runtime
    install_error_handlers(app)
    _install_routes(app, runtime)
    return app


def _build_runtime(settings: GatewaySettings, audit_sink: AuditSink | None,
                   routing_rng: random.Random | None, node_resolver: Resolver,
                   clock: Callable[[], float]) -> GatewayRuntime:
    policy = resolve_policy(settings.policy)
    signer = ResultSigner()
    # Metrics count the audit events as they are emitted: they hold nothing the audit does not.
    metrics = Metrics()
    auditor = GatewayAuditor(MetricsSink(audit_sink or open_sink(settings.audit), metrics), signer.gateway_id)
    pool = NodePool(policy, signer, key_grace_s=settings.key_grace_s, clock=clock)
    keeper = PoolKeeper(settings, pool, auditor, node_resolver)
    limiter = InFlightLimiter(settings.max_in_flight, settings.max_in_flight_per_node, settings.retry_after_s)
    forwarder = Forwarder(keeper, limiter, auditor, settings.accept_timeout_s, routing_rng)
    metrics.gauge("veil_gateway_nodes", lambda: len(pool))
    metrics.gauge("veil_gateway_in_flight", lambda: limiter.in_flight)
    return GatewayRuntime(settings, pool, keeper, forwarder, DirectoryCache(pool, settings.directory_size, settings.directory_epoch_s), auditor, signer,
                          metrics, token_gate_for(policy, settings))


def _install_routes(app: FastAPI, runtime: GatewayRuntime) -> None:
    settings = runtime.settings
    from_relays = [Depends(only_from_relays(settings.relay_only))]

    @app.get(DIRECTORY_PATH, response_model=Directory, summary="The attested directory, the same for every caller")
    async def directory() -> Response:
        return Response(runtime.directory.render(), media_type="application/json")

    @app.get("/v1/attestation-key", summary="The public key that signs the directory's attestation results")
    async def attestation_key() -> dict[str, str]:
        return runtime.signer.public_description()

    @app.get("/v1/health", summary="Liveness and the number of admitted nodes")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "nodes": len(runtime.pool)}

    install_probes(app, lambda: len(runtime.pool) > 0)
    install_metrics(app, runtime.metrics)

    @app.post(INFER_PATH, responses=_ERRORS, openapi_extra=_body_schema(InferBody), dependencies=from_relays,
              summary="Forward one of the client's encapsulations to a uniformly chosen healthy candidate")
    async def infer(request: Request, admission: Admission = Depends(authorize_anonymously),
                    __: None = Depends(refuse_expectations)) -> Response:
        async with token_back_unless_taken(runtime.token_gate, admission):
            body = await read_bounded(request, settings.max_body_bytes)
            candidates = parse_infer_body(body, settings.max_candidates)
            return relay_response(await runtime.forwarder.open(candidates))

    @app.post(NODE_OHTTP_PATH, responses=_ERRORS, dependencies=from_relays,
              summary="Forward a standard RFC 9458 or chunked OHTTP request to one node")
    async def ohttp(request: Request, node_id: str = Path(max_length=64),
                    admission: Admission = Depends(authorize_anonymously),
                    __: None = Depends(refuse_expectations)) -> Response:
        async with token_back_unless_taken(runtime.token_gate, admission):
            media_type = request_media_type(request)
            if not _is_node_id(node_id):
                raise NoCandidateError("that path does not name an admitted node; fetch /v1/nodes")
            body = await read_bounded(request, min(settings.max_body_bytes, MAX_ENCAPSULATED_BYTES))
            if not body:
                raise MalformedRequestError("the body must be the encapsulated OHTTP request")
            return relay_response(await runtime.forwarder.open((Candidate(node_id, media_type, body),)))

    @app.post(NODE_ATTEST_PATH, responses=_ERRORS, dependencies=from_relays,
              summary="Fresh evidence from one node, bound to the client's own nonce")
    async def attest(request: Request, node_id: str = Path(max_length=64)) -> dict[str, str]:
        # No token: a client checks candidates' evidence before each request, and a token spent on
        # that would buy no inference. The in-flight bound below limits this work instead.
        nonce = parse_attest_body(await read_bounded(request, 1024))
        entry = runtime.pool.lookup(node_id) if _is_node_id(node_id) else None
        if entry is None:
            raise NoCandidateError("that path does not name an admitted node; fetch /v1/nodes")
        permit = runtime.forwarder.limiter.admit_request()  # attestation work counts against the bound too
        try:
            answer = await runtime.keeper.client(entry.address).attest(nonce, settings.attest_timeout_s)
        except NodeUnreachableError:
            raise NodeFailedError("the node did not answer the attestation request; fetch /v1/nodes again") from None
        finally:
            permit.release()
        return {"node_id": node_id, "evidence": answer.evidence}

    if settings.allow_registration:
        @app.post("/v1/nodes/register", summary="A node asks to be attested and admitted")
        async def register(request: Request) -> dict[str, Any]:
            address = parse_register_body(await read_bounded(request, 4096))
            admission = await runtime.keeper.register(address)
            return {"node_id": admission.entry.node_id}


def _is_node_id(text: str) -> bool:
    return _NODE_ID.fullmatch(text) is not None


def _body_schema(model: type[InferBody]) -> dict[str, Any]:
    """The OpenAPI request body for a model read by hand (so that its size is bounded first)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _inline(schema, definitions)}}}}


def _inline(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        reference = node.get("$ref")
        if isinstance(reference, str) and reference.startswith("#/$defs/"):
            return _inline(definitions[reference.removeprefix("#/$defs/")], definitions)
        return {key: _inline(value, definitions) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline(item, definitions) for item in node]
    return node


class RelayResponse(StreamingResponse):
    """Streams a node's answer and always closes the route, even if the client is gone before the start."""

    def __init__(self, answer: RelayedAnswer) -> None:
        headers = {NODE_ID_HEADER: answer.route.node_id, "cache-control": "no-store"}
        if answer.route.response_media_type == OHTTP_CHUNKED_RESPONSE:
            # Chunked OHTTP is only useful delivered as it comes: RFC 9842 asks every intermediary
            # (a relay, a load balancer) to forward this response incrementally, never to buffer it.
            headers["incremental"] = "?1"
        super().__init__(answer.chunks(), media_type=answer.route.response_media_type, headers=headers)
        self._answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._answer.close()


def relay_response(answer: RelayedAnswer) -> RelayResponse:
    """The streaming answer for a route that has started."""
    return RelayResponse(answer)
