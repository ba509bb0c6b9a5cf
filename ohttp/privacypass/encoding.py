"""Strict base64url (RFC 4648 §5) as Privacy Pass uses it: padded on output, padded or not on input."""

from __future__ import annotations

import base64
import re

from .errors import MalformedError

_BASE64URL = re.compile(r"[A-Za-z0-9_-]*={0,2}")


def b64url_encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


def b64url_decode(text: str, what: str, max_length: int) -> bytes:
    """Decode `text`, refusing other alphabets, misplaced padding, non-zero trailing bits and overlong input."""
    if len(text) > max_length or not _BASE64URL.fullmatch(text):
        raise MalformedError(f"the {what} is not base64url of an acceptable length")
    unpadded = text.rstrip("=")
    padded = unpadded + "=" * (-len(unpadded) % 4)
    if text != unpadded and text != padded:
        raise MalformedError(f"the {what} has wrong base64url padding")
    try:
        data = base64.urlsafe_b64decode(padded)
    except ValueError:
        raise MalformedError(f"the {what} is not valid base64url") from None
    if b64url_encode(data) != padded:
        raise MalformedError(f"the {what} is not canonical base64url")
    return data
