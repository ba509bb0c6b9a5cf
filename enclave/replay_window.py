"""The replay window: a request whose `Date` is too far from the node's clock is refused.

RFC 9458 section 6.5: a captured ciphertext can then be replayed only within the window, and the
node still keeps no state about requests. Plain OHTTP clients may send no Date; they get no window.
"""

from __future__ import annotations

from ohttp.bhttp import Request
from ohttp.dates import date_fields, parse_http_date
from enclave.api_types import ApiError
from protocol.codes import DATE_OUT_OF_WINDOW

REQUEST_DATE_WINDOW_S = 60.0


class DateOutOfWindow(ApiError):
    def __init__(self, window_s: float) -> None:
        super().__init__(400, DATE_OUT_OF_WINDOW,
                         f"the request's Date differs from the node's clock by more than {window_s:g} s; "
                         "correct the sender's clock and send the request again")


def check_date(request: Request, now: float, window_s: float) -> None:
    """Raises ApiError for a malformed or repeated Date, DateOutOfWindow for one outside the window."""
    dates = date_fields(request.headers)
    if not dates:
        return
    if len(dates) > 1:
        raise ApiError(400, "invalid_date", "send at most one Date field")
    try:
        sent = parse_http_date(dates[0])
    except ValueError:
        raise ApiError(400, "invalid_date", "the Date field is not an HTTP date") from None
    if abs(now - sent) > window_s:
        raise DateOutOfWindow(window_s)
