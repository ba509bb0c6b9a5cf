"""One attempt at the gateway: posting the sealed candidates to `/v1/infer`, and reading its reply.

The gateway either names the node it chose (and the answer, still encrypted, follows) or refuses
with a status and an error code; a refusal becomes a `GatewayError` carrying what `client.retries`
decides on (the status, the code and any Retry-After). The gateway's own message is never shown:
only its code, checked to be a short identifier. The SDK's HTTP clients keep no cookie
(`keep_no_cookies`): nothing sent with a request comes from an earlier answer.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

from client import wire
from client.errors import UNREACHABLE, GatewayError, ResponseIntegrityError
from protocol import codes
from protocol.constants import INFER_PATH, NODE_ID_HEADER


def keep_no_cookies(http: httpx.Client) -> httpx.Client:
    """`http` with a cookie jar that refuses every cookie: one that a gateway, relay or issuer set on an
    answer would otherwise go back with every later request, linking them."""
    http.cookies = CookieJar(DefaultCookiePolicy(allowed_domains=()))
    return http


def post_candidates(http: httpx.Client, sealed: Sequence[wire.SealedRequest], authorization: str | None,
                    timeout: httpx.Timeout) -> httpx.Response:
    """POST the candidates; the answer's body is left to read (it may be a stream)."""
    payload = {"candidates": [
        {"node_id": s.node_id, "media_type": s.media_type, "encapsulated": base64.b64encode(s.encapsulated).decode()}
        for s in sealed
    ]}
    headers = {"authorization": authorization} if authorization is not None else None
    try:
        request = http.build_request("POST", INFER_PATH, json=payload, headers=headers, timeout=timeout)
        return http.send(request, stream=True)
    except httpx.HTTPError as error:
        raise GatewayError(UNREACHABLE, "unreachable", f"the request could not be sent ({type(error).__name__}); "
                           "check that the gateway runs and send again") from None


def served(sealed: Sequence[wire.SealedRequest], response: httpx.Response) -> wire.SealedRequest:
    """The candidate the gateway chose, by the node id it names; only ours can be decrypted anyway."""
    node_id = response.headers.get(NODE_ID_HEADER, "")
    for candidate in sealed:
        if candidate.node_id == node_id:
            return candidate
    raise ResponseIntegrityError(None, "the gateway names a node this request was not encrypted to")


# The gateway's refusals that it decides before any node takes the request, giving the token back (gateway.auth):
# the client keeps that token for its next attempt instead of spending a new one.
TOKEN_GIVEN_BACK = {(503, "overloaded"), (503, "token_store_unavailable"), (404, codes.NO_CANDIDATE),
                    (502, codes.NODE_FAILED)}


def token_given_back(refusal: GatewayError) -> bool:
    """Whether the gateway refused before spending, or gave the token back (see TOKEN_GIVEN_BACK)."""
    return (refusal.status, refusal.code) in TOKEN_GIVEN_BACK


def gateway_refusal(response: httpx.Response) -> GatewayError:
    """The error a refusing reply stands for (its body is read and the response closed)."""
    try:
        code = _gateway_code(response)
    finally:
        response.close()
    retry_after = _retry_after(response)
    hint = f"retry after {retry_after:g} s" if retry_after is not None else wire.gateway_advice(code)
    return GatewayError(response.status_code, code, f"the request was not served; {hint}", retry_after)


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
