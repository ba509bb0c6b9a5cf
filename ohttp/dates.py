"""HTTP dates in Binary HTTP fields, for the Date check RFC 9458 section 6.5 suggests against replay.

The sender stamps its clock into the inner request; the gateway resource (here: the node) refuses
a date too far from its own and answers with its own time, from which the sender may correct its
clock. Only the field format lives here; the window is the node's business.
"""

from __future__ import annotations

from datetime import timezone
from email.utils import formatdate, parsedate_to_datetime

from ohttp.bhttp import Fields


def format_http_date(seconds: float) -> bytes:
    """An IMF-fixdate (RFC 9110 section 5.6.7), the form senders must use."""
    return formatdate(seconds, usegmt=True).encode("ascii")


def parse_http_date(value: bytes) -> float:
    """Seconds since the epoch; ValueError if `value` is not an HTTP date."""
    try:
        moment = parsedate_to_datetime(value.decode("ascii"))
    except (ValueError, TypeError, IndexError, OverflowError, UnicodeDecodeError):
        raise ValueError("not an HTTP date") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)  # "-0000": UTC by definition
    return moment.timestamp()


def date_fields(fields: Fields) -> list[bytes]:
    """Every `Date` field's value, in order (field names are case-insensitive)."""
    return [value for name, value in fields if name.lower() == b"date"]
