"""Anonymous authorization: the one place that decides whether a request may use the fleet.

Today every request is admitted. This dependency is where Privacy-Pass-style
tokens (RFC 9576–9578: blindly issued, unlinkable to their issuance) will be
redeemed: the handler will read one `Authorization: PrivateToken …` value,
check its issuer signature and spend it once, and admit or refuse — without
ever learning or recording who the client is.

To keep that promise structurally, the hook receives nothing about the
connection: no `Request`, no address, no other header. A future token
parameter must stay the only input, and nothing here may log or store it
beyond the double-spend check.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Admission:
    """The authorization decision for one request; it carries no identity by construction."""

    admitted: bool
    scheme: str


_OPEN_ADMISSION = Admission(admitted=True, scheme="open")


async def authorize_anonymously() -> Admission:
    """Admit the request (no token scheme is deployed yet); see the module docstring."""
    return _OPEN_ADMISSION
