"""The log's read-only file server and the witness's endpoint, as FastAPI applications.

Neither keeps an access log (they run under `serving.server.serve_app`). The log server answers
`GET /checkpoint` and `GET /tile/...` from the directory: no listing, no path outside the tile
layout. Full tiles and bundles never change, so they may be cached forever. Given a writer (`veil log
serve --key`), it also takes attested nodes' key statements (`POST /add-node-key`) and gives nodes
their proofs to staple (`GET /proof/N`, `GET /release-index`); clients never ask it anything.

Anyone who reaches the log can post an append, and the log verifies its evidence (certificate chains,
signatures, RIMs) before refusing it: work a sender gets for free. So only `max_appends_in_flight`
appends are verified at once (a slot is taken once the body is in), and one past that is refused at
once (503 with Retry-After, as the gateway refuses overload), never queued, so the reads that clients'
proofs come from keep being served.
"""

from __future__ import annotations

import base64
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from attestation.transparency.errors import ForkError, NoteSignatureError, ProofError, TransparencyError
from attestation.transparency.node_append import APPEND_PATH, MAX_APPEND_BYTES, AppendRefusedError, parse_append_request
from attestation.transparency.tiles import TILE_WIDTH, parse_tile_path
from serving.errors import OverloadedError
from serving.responses import install_error_handlers, read_bounded
from transparency.errors import LogStoreError, StaleSizeError, UnknownLogError
from transparency.fetch import directory_fetch
from transparency.protocol import MAX_REQUEST_BYTES, SIZE_MEDIA_TYPE, cosignature_line, parse_add_checkpoint
from transparency.witness import Witness
from transparency.writer import LogWriter

_NO_DOCS = {"openapi_url": None, "docs_url": None, "redoc_url": None}
DEFAULT_MAX_APPENDS_IN_FLIGHT = 4
_APPENDS_FULL = "the log is verifying as many appends as it takes at once; retry after the Retry-After delay"
_APPEND_RETRY_AFTER_S = 1


def log_app(directory: Path, writer: LogWriter | None = None,
            max_appends_in_flight: int = DEFAULT_MAX_APPENDS_IN_FLIGHT) -> FastAPI:
    """Serve the log in `directory`: read-only, and with `writer` also nodes' appends and proofs."""
    if max_appends_in_flight < 1:
        raise ValueError("max_appends_in_flight must be at least 1")
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

    if writer is not None:
        _node_routes(app, writer, max_appends_in_flight)
    return app


def _refusal(error: TransparencyError) -> JSONResponse:
    status = 403 if isinstance(error, AppendRefusedError) else 404 if isinstance(error, LogStoreError) else 400
    return JSONResponse({"error": str(error)}, status_code=status)


def _node_routes(app: FastAPI, writer: LogWriter, max_appends_in_flight: int) -> None:
    # Appends being verified, counted on the event loop's one thread. A slot is taken only once the body
    # is in and parsed: a sender trickling its body in holds no slot from the nodes behind it.
    appending = [0]

    @app.post(APPEND_PATH)
    async def add_node_key(request: Request) -> Response:
        body = await read_bounded(request, MAX_APPEND_BYTES)
        try:
            append = parse_append_request(body)
        except TransparencyError as error:
            return _refusal(error)
        if appending[0] >= max_appends_in_flight:
            raise OverloadedError(_APPENDS_FULL, _APPEND_RETRY_AFTER_S)
        appending[0] += 1
        try:
            index = await run_in_threadpool(writer.append_node_key, append)
        except TransparencyError as error:
            return _refusal(error)
        finally:
            appending[0] -= 1
        return JSONResponse({"index": index})

    @app.get("/proof/{index}")
    async def proof(index: int) -> Response:
        try:
            stapled = await run_in_threadpool(writer.stapled, index)
        except TransparencyError as error:
            return _refusal(error)
        return JSONResponse({"entry": base64.b64encode(stapled.entry).decode(),
                             "proof": base64.b64encode(stapled.proof).decode()}, headers={"cache-control": "no-cache"})

    @app.get("/release-index")
    async def release_index(code: str, policy: str, model: str) -> Response:
        index = await run_in_threadpool(writer.release_index, code, policy, model)
        if index is None:
            return JSONResponse({"error": "no release statement lists these digests"}, status_code=404)
        return JSONResponse({"index": index})


# Each refusal of the witness, and the status c2sp.org/tlog-witness gives it (a stale `old`, 409 with the
# witness's size, is answered apart). A fork (another root at the witness's size, or a size-0 tree with a
# root but the empty one) and any proof that cannot lead from the witness's tree are 422.
_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (UnknownLogError, 404), (NoteSignatureError, 403), (ForkError, 422), (ProofError, 422),
    (LogStoreError, 500), (TransparencyError, 400),
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
            # Exactly the spec's type: Starlette would append "; charset=utf-8" to a text/ media type.
            return Response(f"{error.size}\n", status_code=409, headers={"content-type": SIZE_MEDIA_TYPE})
        except TransparencyError as error:
            status = next(code for kind, code in _STATUS if isinstance(error, kind))
            return PlainTextResponse(f"{error}\n", status_code=status)
        return Response(cosignature_line(signature), media_type="text/plain; charset=utf-8")

    return app
