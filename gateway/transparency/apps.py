"""The log's read-only file server and the witness's endpoint, as FastAPI applications.

Neither keeps an access log (they run under `gateway.serve.serve_app`). The log server answers
`GET /checkpoint` and `GET /tile/...` from the directory and nothing else: no listing, no path
outside the tile layout. Full tiles and bundles never change, so they may be cached forever.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from attestation.transparency.errors import (
    ConsistencyProofError,
    ForkError,
    NoteSignatureError,
    RollbackError,
    TransparencyError,
)
from attestation.transparency.tiles import TILE_WIDTH, parse_tile_path
from gateway.responses import install_error_handlers, read_bounded
from gateway.transparency.errors import LogStoreError, StaleSizeError, UnknownLogError
from gateway.transparency.fetch import directory_fetch
from gateway.transparency.protocol import MAX_REQUEST_BYTES, SIZE_MEDIA_TYPE, cosignature_line, parse_add_checkpoint
from gateway.transparency.witness import Witness

_NO_DOCS = {"openapi_url": None, "docs_url": None, "redoc_url": None}


def log_app(directory: Path) -> FastAPI:
    """Serve the log in `directory`, read-only."""
    app = FastAPI(title="Veil transparency log", **_NO_DOCS)
    install_error_handlers(app)
    fetch = directory_fetch(directory)

    @app.get("/checkpoint")
    async def checkpoint() -> Response:
        data = await run_in_threadpool(fetch, "checkpoint")
        if data is None:
            return PlainTextResponse("no checkpoint yet\n", status_code=404)
        return Response(data, media_type="text/plain; charset=utf-8", headers={"cache-control": "no-cache"})

    @app.get("/tile/{rest:path}")
    async def tile(rest: str) -> Response:
        path = f"tile/{rest}"
        try:
            name = parse_tile_path(path)
        except TransparencyError:
            return PlainTextResponse("not a tile path\n", status_code=404)
        data = await run_in_threadpool(fetch, path)
        if data is None:
            return PlainTextResponse("no such tile\n", status_code=404)
        cache = "public, max-age=31536000, immutable" if name.width == TILE_WIDTH else "no-cache"
        return Response(data, media_type="application/octet-stream", headers={"cache-control": cache})

    return app


# Each refusal of the witness, and the status tlog-witness gives it.
_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (UnknownLogError, 404), (NoteSignatureError, 403), (RollbackError, 409), (ForkError, 409),
    (ConsistencyProofError, 422), (LogStoreError, 500), (TransparencyError, 400),
)


def witness_app(witness: Witness) -> FastAPI:
    """POST /add-checkpoint: the cosignature line, or a refusal with a one-line reason."""
    app = FastAPI(title="Veil witness", **_NO_DOCS)
    install_error_handlers(app)

    @app.post("/add-checkpoint")
    async def add_checkpoint(request: Request) -> Response:
        body = await read_bounded(request, MAX_REQUEST_BYTES)
        try:
            parsed = parse_add_checkpoint(body)
            signature = await run_in_threadpool(witness.add_checkpoint, parsed.old_size, parsed.proof, parsed.note)
        except StaleSizeError as error:
            return Response(f"{error.size}\n", status_code=409, media_type=SIZE_MEDIA_TYPE)
        except TransparencyError as error:
            status = next(code for kind, code in _STATUS if isinstance(error, kind))
            return PlainTextResponse(f"{error}\n", status_code=status)
        return Response(cosignature_line(signature), media_type="text/plain; charset=utf-8")

    return app
