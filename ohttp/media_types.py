"""Media types of Oblivious HTTP (RFC 9458), chunked OHTTP and Binary HTTP (RFC 9292)."""

from __future__ import annotations

OHTTP_REQUEST = "message/ohttp-req"
OHTTP_RESPONSE = "message/ohttp-res"
OHTTP_CHUNKED_REQUEST = "message/ohttp-chunked-req"
OHTTP_CHUNKED_RESPONSE = "message/ohttp-chunked-res"
BHTTP = "message/bhttp"
