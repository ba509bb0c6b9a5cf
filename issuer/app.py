"""The issuer's FastAPI application: its key directory and the token-request endpoint, nothing else.

A token request is answered only for an authenticated account within its
quota. The handler reads the body, blindly signs it and forgets it: neither
the blinded message nor the blind signature is stored, logged or counted
anywhere but in the account's token count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from serving.errors import UnsupportedMediaTypeError
from issuer.accounts import authenticate
from issuer.config import IssuerConfig
from issuer.errors import TokenRequestError
from issuer.keys import IssuerKeyring
from issuer.quota import QuotaLedger
from audit.metrics import Metrics
from serving.probes import install_metrics, install_probes
from serving.responses import install_error_handlers, read_bounded
from ohttp.privacypass import (
    TOKEN_REQUEST_MEDIA_TYPE,
    TOKEN_RESPONSE_MEDIA_TYPE,
    WELL_KNOWN_PATH,
    IssuerDirectory,
    PrivacyPassError,
    answer_token_request,
    encode_directory,
)
from ohttp.privacypass.directory import MEDIA_TYPE as DIRECTORY_MEDIA_TYPE

MAX_TOKEN_REQUEST_BYTES = 1024


@dataclass(slots=True)
class IssuerRuntime:
    config: IssuerConfig
    keyring: IssuerKeyring
    ledger: QuotaLedger
    clock: Callable[[], float]


def create_issuer_app(
    config: IssuerConfig, keyring: IssuerKeyring, *, clock: Callable[[], float] = time.time
) -> FastAPI:
    """The issuer application; `clock` is the time keys and quotas are judged by."""
    runtime = IssuerRuntime(config, keyring, QuotaLedger(config.tokens_per_period, config.period_s, clock), clock)
    app = FastAPI(title="Veil token issuer", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    install_error_handlers(app)
    request_path = urlsplit(config.request_uri).path or "/token-request"
    # Ready while a key signs now: before its first key's not-before an issuer could only refuse.
    install_probes(app, lambda: any(dated.not_before <= clock() for dated in keyring.published(clock())))
    metrics = Metrics()
    install_metrics(app, metrics)
    # Counted by outcome alone: an account's name would tell who asks when.
    token_requests = metrics.counter("veil_issuer_token_requests")

    @app.get(WELL_KNOWN_PATH)
    async def directory() -> Response:
        published = IssuerDirectory(config.request_uri, keyring.directory_keys(clock()))
        return Response(encode_directory(published), media_type=DIRECTORY_MEDIA_TYPE,
                        headers={"cache-control": "max-age=60"})

    @app.post(request_path)
    async def token_request(request: Request) -> Response:
        try:
            answer = await _answer(request)
        except Exception:
            token_requests.labels("refused").inc()
            raise
        token_requests.labels("issued").inc()
        return answer

    async def _answer(request: Request) -> Response:
        account = authenticate(request.headers.get("authorization"), config.accounts, config.issuer_name)
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != TOKEN_REQUEST_MEDIA_TYPE:
            raise UnsupportedMediaTypeError(f"a token request must be sent as {TOKEN_REQUEST_MEDIA_TYPE}")
        body = await read_bounded(request, MAX_TOKEN_REQUEST_BYTES)
        runtime.ledger.take(account.name)
        try:
            answer = await run_in_threadpool(answer_token_request, keyring.signing_keys(clock()), body)
        except PrivacyPassError:
            runtime.ledger.give_back(account.name)
            raise TokenRequestError("the body is not a type 2 token request for a key this issuer publishes; "
                                    "fetch its directory and blind again") from None
        return Response(answer, media_type=TOKEN_RESPONSE_MEDIA_TYPE, headers={"cache-control": "no-store"})

    return app
