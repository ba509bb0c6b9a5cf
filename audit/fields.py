"""Field types of the audit schema: what one field of an event may hold.

Every event field is declared with one of these specs (through `Annotated`
aliases such as `NodeId`), so a single description drives validation at
construction, validation of stored records and the JSON Schema export. None of
them admits free text: strings are either identifiers matching a strict
pattern or labels from a closed list.
"""

from __future__ import annotations

import enum
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from audit.buckets import LATENCY_BUCKETS, TOKEN_BUCKETS
from audit.errors import AuditSchemaError

# JSON numbers above 2**53 lose precision in many readers; nothing in an audit
# event needs to be that large.
MAX_JSON_INT = 2**53 - 1


class FieldSpec(Protocol):
    """What a field may hold; `check` returns the value in canonical form or raises."""

    description: str

    def check(self, value: Any, where: str) -> Any: ...

    def json_schema(self) -> dict[str, Any]: ...


def _reject(where: str, description: str) -> AuditSchemaError:
    # `where` is "Kind.field"; the value itself is never part of the message.
    kind, _, field = where.partition(".")
    return AuditSchemaError(
        f"field {field!r} of {kind} must be {description}; "
        "audit events carry only numbers, buckets, enums and identifiers",
        kind=kind,
        field=field,
    )


@dataclass(frozen=True, slots=True)
class Identifier:
    """An identifier of a node, gateway, policy or release, matching a strict pattern."""

    pattern: str
    description: str
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # ASCII: without it \d and friends would admit non-ASCII digits.
        object.__setattr__(self, "regex", re.compile(self.pattern, re.ASCII))

    def check(self, value: Any, where: str) -> str:
        if type(value) is not str or self.regex.fullmatch(value) is None:
            raise _reject(where, self.description)
        return value

    def json_schema(self) -> dict[str, Any]:
        return {"type": "string", "pattern": f"^{self.pattern}$", "description": self.description}


@dataclass(frozen=True, slots=True)
class Count:
    """A whole number in [minimum, maximum]."""

    minimum: int = 0
    maximum: int = MAX_JSON_INT
    description: str = "a non-negative integer"

    def check(self, value: Any, where: str) -> int:
        if type(value) is not int or not self.minimum <= value <= self.maximum:
            raise _reject(where, f"an int in [{self.minimum}, {self.maximum}]")
        return value

    def json_schema(self) -> dict[str, Any]:
        return {"type": "integer", "minimum": self.minimum, "maximum": self.maximum,
                "description": self.description}


@dataclass(frozen=True, slots=True)
class Bucket:
    """A label from a fixed list of buckets (see `audit.buckets`)."""

    labels: tuple[str, ...]
    description: str

    def check(self, value: Any, where: str) -> str:
        if type(value) is not str or value not in self.labels:
            raise _reject(where, f"{self.description} (one of the fixed bucket labels)")
        return value

    def json_schema(self) -> dict[str, Any]:
        return {"enum": list(self.labels), "description": self.description}


@dataclass(frozen=True, slots=True)
class Choice:
    """A member of an enum; its string value is accepted and converted to the member."""

    enum_type: type[enum.Enum]
    description: str
    by_value: dict[str, enum.Enum] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_value", {member.value: member for member in self.enum_type})

    def check(self, value: Any, where: str) -> enum.Enum:
        if type(value) is self.enum_type:
            return value
        member = self.by_value.get(value) if type(value) is str else None
        if member is None:
            raise _reject(where, f"a member of {self.enum_type.__name__}")
        return member

    def json_schema(self) -> dict[str, Any]:
        return {"enum": [member.value for member in self.enum_type], "description": self.description}


@dataclass(frozen=True, slots=True)
class Sequence:
    """A tuple of items of one spec (identifiers or counts, kept as given), of bounded length, without repeats."""

    item: FieldSpec
    min_items: int
    max_items: int
    description: str

    def check(self, value: Any, where: str) -> tuple[Any, ...]:
        if type(value) not in (tuple, list) or not self.min_items <= len(value) <= self.max_items:
            raise _reject(where, f"a sequence of {self.min_items} to {self.max_items} items")
        for item in value:
            if self.item.check(item, where) is not item:
                raise _reject(where, "a sequence of items in canonical form")
        if len(set(value)) != len(value):
            raise _reject(where, "a sequence without repeated items")
        return value if type(value) is tuple else tuple(value)

    def json_schema(self) -> dict[str, Any]:
        return {"type": "array", "items": self.item.json_schema(), "minItems": self.min_items,
                "maxItems": self.max_items, "uniqueItems": True, "description": self.description}


@dataclass(frozen=True, slots=True)
class Nullable:
    """Either a value of `inner`, or None (JSON null) when there is nothing to report."""

    inner: FieldSpec
    description: str

    def check(self, value: Any, where: str) -> Any:
        return None if value is None else self.inner.check(value, where)

    def json_schema(self) -> dict[str, Any]:
        return {"anyOf": [self.inner.json_schema(), {"type": "null"}], "description": self.description}


@dataclass(frozen=True, slots=True)
class Tally:
    """One count per member of an enum: a JSON object keyed by every member's value, and nothing else."""

    enum_type: type[enum.Enum]
    description: str

    def check(self, value: Any, where: str) -> Mapping[str, int]:
        names = [member.value for member in self.enum_type]
        if not isinstance(value, Mapping) or len(value) != len(names) or not all(name in value for name in names):
            raise _reject(where, f"an object with one count for each of {', '.join(names)}")
        counts = {name: COUNT.check(value[name], where) for name in names}
        if type(value) is types.MappingProxyType and list(value.items()) == list(counts.items()):
            return value
        return types.MappingProxyType(counts)  # read-only, like the frozen event that holds it

    def json_schema(self) -> dict[str, Any]:
        names = [member.value for member in self.enum_type]
        return {"type": "object", "properties": {name: COUNT.json_schema() for name in names},
                "required": names, "additionalProperties": False, "description": self.description}


NODE_ID = Identifier("[0-9a-f]{16,64}", "a node identifier: lowercase hex, 16 to 64 characters")
GATEWAY_ID = Identifier("[0-9a-f]{16,64}", "a gateway identifier: lowercase hex, 16 to 64 characters")
POLICY_DIGEST = Identifier("[0-9a-f]{64}", "a policy digest: SHA-256 as 64 lowercase hex characters")
# Semver-like: MAJOR.MINOR.PATCH with an optional pre-release of a fixed vocabulary
# (PEP 440 "rc1"/".dev3" or semver "-rc.1"), so a release string cannot spell words.
RELEASE = Identifier(
    r"(?:0|[1-9][0-9]{0,3})\.(?:0|[1-9][0-9]{0,3})\.(?:0|[1-9][0-9]{0,3})"
    r"(?:(?:a|b|rc|\.dev|\.post)[0-9]{1,4}|-(?:alpha|beta|rc|dev)(?:\.[0-9]{1,4})?)?",
    "a release: MAJOR.MINOR.PATCH with an optional a/b/rc/dev/post number",
)
# An issuer key's id (RFC 9578: SHA-256 of the key): public, and listed by the measured policy.
ISSUER_KEY_ID = Identifier("[0-9a-f]{64}", "an issuer key id: SHA-256 as 64 lowercase hex characters")
TOKEN_BUCKET = Bucket(TOKEN_BUCKETS, "a token-count bucket")
LATENCY_BUCKET = Bucket(LATENCY_BUCKETS, "a latency bucket")
COUNT = Count()
CAPACITY = Count(1, 1_000_000, "a node's capacity weight: concurrent sequences it serves")
TALLY_PERIOD = Count(1, 31 * 86400, "the whole seconds a tally covers, ending at its timestamp")

# Aliases used in event declarations; the spec rides along as Annotated metadata.
NodeId = Annotated[str, NODE_ID]
GatewayId = Annotated[str, GATEWAY_ID]
PolicyDigest = Annotated[str, POLICY_DIGEST]
Release = Annotated[str, RELEASE]
TokenBucket = Annotated[str, TOKEN_BUCKET]
LatencyBucket = Annotated[str, LATENCY_BUCKET]
OptionalLatencyBucket = Annotated[str | None, Nullable(LATENCY_BUCKET, "a latency bucket, or null when none applies")]
Counter = Annotated[int, COUNT]
Capacity = Annotated[int, CAPACITY]
NodeIds = Annotated[tuple[str, ...], Sequence(NODE_ID, 1, 64, "node identifiers")]
OptionalIssuerKeyId = Annotated[str | None, Nullable(ISSUER_KEY_ID, "an issuer key id, or null when the "
                                                                   "token named no key the policy lists")]
TallyPeriod = Annotated[int, TALLY_PERIOD]
OptionalNodeId = Annotated[str | None, Nullable(NODE_ID, "a node identifier, or null when no node was chosen")]
