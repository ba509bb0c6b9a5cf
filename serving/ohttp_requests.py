"""What every server that takes OHTTP requests checks of them before reading a byte (the gateway, the relay)."""

from __future__ import annotations

from fastapi import Request

from ohttp.media_types import OHTTP_CHUNKED_REQUEST, OHTTP_REQUEST
from serving.errors import ExpectationFailedError, UnsupportedMediaTypeError

REQUEST_MEDIA_TYPES = frozenset({OHTTP_REQUEST, OHTTP_CHUNKED_REQUEST})


async def refuse_expectations(request: Request) -> None:
    """Refuse (417) an OHTTP request that carries `Expect`, before a byte of its body is read.

    RFC 9458 section 5.1 forbids the 100-continue expectation for OHTTP; answering before reading
    the body means no 100 (Continue) interim response is ever sent.
    """
    if "expect" in request.headers:
        raise ExpectationFailedError("OHTTP requests must not carry Expect (RFC 9458 section 5.1); send the "
                                     "request without it, body included")


def request_media_type(request: Request) -> str:
    """The declared OHTTP request media type, or UnsupportedMediaTypeError (415)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type not in REQUEST_MEDIA_TYPES:
        raise UnsupportedMediaTypeError("the content type must be message/ohttp-req or message/ohttp-chunked-req")
    return media_type
