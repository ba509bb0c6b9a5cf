"""The relay's own error; the rest it answers with are every Veil server's (`serving.errors`)."""

from __future__ import annotations

from serving.errors import ServingError


class GatewayUnreachableError(ServingError):
    """A relay could not reach the gateway it forwards to, or lost it before its answer began."""

    status = 502
    code = "gateway_unreachable"
