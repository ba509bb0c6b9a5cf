"""Kubernetes-style probes and Prometheus' `/metrics` for the gateway and the issuer (the relay serves only the probes here).

`/livez` answers 200 while the process serves HTTP at all: restarting it would not help otherwise.
`/readyz` answers 200 only while the server can do its work (the gateway: at least one admitted
node; the relay: its gateway is ready; the issuer: a signing key is valid now), else 503, so a
Service sends no traffic to it meanwhile. Both answers are fixed JSON; neither reads the request.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from audit.metrics import CONTENT_TYPE, Metrics

LIVENESS_PATH = "/livez"
METRICS_PATH = "/metrics"
READINESS_PATH = "/readyz"

Readiness = Callable[[], bool] | Callable[[], Awaitable[bool]]


def install_probes(app: FastAPI, ready: Readiness) -> None:
    """Add `/livez` and `/readyz` (whose answer `ready` decides) to `app`."""

    @app.get(LIVENESS_PATH, summary="Liveness: the process serves", include_in_schema=False)
    async def livez() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get(READINESS_PATH, summary="Readiness: the server can do its work now", include_in_schema=False)
    async def readyz() -> JSONResponse:
        answer = ready()
        is_ready = await answer if inspect.isawaitable(answer) else answer
        if is_ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not_ready"}, status_code=503, headers={"retry-after": "1"})


def install_metrics(app: FastAPI, metrics: Metrics) -> None:
    """Add `/metrics`: the exposition of `metrics` (the names and labels of `audit.metrics.METRICS` only)."""

    @app.get(METRICS_PATH, summary="Prometheus metrics: aggregates of the audit events", include_in_schema=False)
    async def exposition() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)
