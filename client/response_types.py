"""The Responses API's results (`client.responses.create`): a Response, and the events of a streamed one.

Both keep the node's JSON whole (the Response object has many fields, all passed on by `veil proxy` as
the node stated them) after checking the parts the SDK reads, so a malformed answer raises `ValueError`
(a `ResponseIntegrityError` to the caller), as `client.types` does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from client.types import Route, _get, _list, _Receipted


@dataclass(frozen=True, slots=True)
class Response(_Receipted):
    """A whole Responses answer (`object == "response"`): `output` items, `output_text`, `usage`."""

    id: str
    model: str
    status: str
    output: tuple[dict[str, Any], ...]
    usage: dict[str, Any] | None
    data: dict[str, Any] = field(repr=False, compare=False)
    route: Route | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, data: Any, route: Route | None = None) -> Response:
        if _get(data, "object", str) != "response":
            raise ValueError("not a response object")
        output = tuple(_item(item) for item in _list(data, "output"))
        return cls(_get(data, "id", str), _get(data, "model", str), _get(data, "status", str), output,
                   _get(data, "usage", dict, None), copy.deepcopy(data), route)

    @property
    def output_text(self) -> str:
        """The text of every message item, joined, as OpenAI's SDK gives it."""
        return "".join(part.get("text", "") for item in self.output if item["type"] == "message"
                       for part in item.get("content") or [] if part.get("type") == "output_text")

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.data)


def _item(item: Any) -> dict[str, Any]:
    _get(item, "type", str)
    return item


@dataclass(frozen=True, slots=True)
class ResponseStreamEvent:
    """One event of a streamed Responses answer: its `type` (`response.output_text.delta`, ...) and fields."""

    type: str
    sequence_number: int
    data: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: Any) -> ResponseStreamEvent:
        return cls(_get(data, "type", str), _get(data, "sequence_number", int), copy.deepcopy(data))

    @property
    def delta(self) -> str | None:
        """The text or arguments a delta event adds; None for other events."""
        value = self.data.get("delta")
        return value if isinstance(value, str) else None

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.data)
