"""The typed audit events: the only data that leaves a node besides ciphertext.

Each event is a frozen dataclass whose fields are numbers, bucket labels, enum
members or identifiers of nodes, gateways, policies and releases (see
`audit.fields`). Construction validates every field, and so does emission
(`validate_event`), so an event that could carry free text cannot exist.

On the wire an event is one JSON object: `schema` (the schema version),
`kind`, `ts` and the fields, in declaration order. `ts` is whole seconds:
finer timestamps would let anyone holding both the audit stream and a network
trace join an event to one user's packets, and the sinks flush once a second
anyway, so sub-second precision would buy nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from audit.errors import AuditSchemaError
from audit.fields import (
    Capacity,
    Choice,
    Counter,
    FieldSpec,
    GatewayId,
    LatencyBucket,
    NodeId,
    NodeIds,
    OptionalLatencyBucket,
    OptionalIssuerKeyId,
    OptionalNodeId,
    PolicyDigest,
    Release,
    Tally,
    TallyPeriod,
    TokenBucket,
)

SCHEMA_VERSION = "veil.audit/1"
# Timestamps are floored to this many seconds (see the module docstring).
TS_RESOLUTION_S = 1


class AttestationBackend(enum.StrEnum):
    """Which attestation backend produced a node's evidence."""

    SIM = "sim"
    NVML = "nvml"
    TSM = "tsm"


class StopReason(enum.StrEnum):
    """Why a node process stopped."""

    SHUTDOWN = "shutdown"
    SELF_CHECK_FAILED = "self_check_failed"
    ATTESTATION_FAILED = "attestation_failed"
    POLICY_VIOLATION = "policy_violation"
    ENGINE_ERROR = "engine_error"


class EvidenceOutcome(enum.StrEnum):
    """How refreshing a node's evidence went."""

    OK = "ok"
    BACKEND_ERROR = "backend_error"
    VERIFICATION_FAILED = "verification_failed"


class ProofRefreshOutcome(enum.StrEnum):
    """How a node's refresh of its stapled transparency proofs went."""

    OK = "ok"
    LOG_UNREACHABLE = "log_unreachable"
    LOG_REFUSED = "log_refused"
    RELEASE_NOT_LOGGED = "release_not_logged"


class ProofFreshness(enum.StrEnum):
    """How close a node's stapled proofs are to the policy's max_checkpoint_age_s (after the refresh)."""

    FRESH = "fresh"  # younger than half the allowed age
    AGING = "aging"  # older than half: refreshes are failing, clients still accept them
    EXPIRING = "expiring"  # in the last tenth of the allowed age: the node reads not ready
    EXPIRED = "expired"  # clients refuse the node
    NONE = "none"  # no proofs stapled, or no age to keep (the policy requires no witness)


class RequestStatus(enum.StrEnum):
    """How one inference request ended on a node."""

    OK = "ok"
    CLIENT_ERROR = "client_error"
    DECRYPT_ERROR = "decrypt_error"
    ABORTED = "aborted"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    ENGINE_ERROR = "engine_error"


class RouteOutcome(enum.StrEnum):
    """How the gateway's routing of one request ended."""

    OK = "ok"
    FAILOVER = "failover"
    NODE_ERROR = "node_error"
    NO_CANDIDATE = "no_candidate"
    OVERLOADED = "overloaded"


class EvictionReason(enum.StrEnum):
    """Why a gateway removed a node from its directory."""

    ATTESTATION_FAILED = "attestation_failed"
    EVIDENCE_EXPIRED = "evidence_expired"
    UNREACHABLE = "unreachable"
    POLICY_MISMATCH = "policy_mismatch"
    DRAINED = "drained"


class TokenRefusal(enum.StrEnum):
    """Why the gateway refused a request's Privacy Pass token."""

    MISSING = "missing"
    MALFORMED = "malformed"
    UNKNOWN_KEY = "unknown_key"
    WRONG_CHALLENGE = "wrong_challenge"
    SPENT = "spent"
    STORE_UNREACHABLE = "store_unreachable"


# Refused before the token is known to name a listed key: counted under no key id, since any other
# id would be whatever the client chose to write.
UNKEYED_REFUSALS = frozenset({TokenRefusal.MISSING, TokenRefusal.MALFORMED, TokenRefusal.UNKNOWN_KEY})


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """Base of every audit event; subclasses declare `kind` and typed fields."""

    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        validate_event(self)


@dataclass(frozen=True, slots=True)
class NodeStarted(AuditEvent):
    """A node passed its self-checks and began serving under a policy and release."""

    kind: ClassVar[str] = "node_started"
    node_id: NodeId
    policy_digest: PolicyDigest
    release: Release
    backend: AttestationBackend


@dataclass(frozen=True, slots=True)
class NodeStopped(AuditEvent):
    """A node process stopped."""

    kind: ClassVar[str] = "node_stopped"
    node_id: NodeId
    reason: StopReason


@dataclass(frozen=True, slots=True)
class EvidenceRefreshed(AuditEvent):
    """A node collected fresh attestation evidence (on its timer or on demand)."""

    kind: ClassVar[str] = "evidence_refreshed"
    node_id: NodeId
    outcome: EvidenceOutcome


@dataclass(frozen=True, slots=True)
class ProofsRefreshed(AuditEvent):
    """A node tried to refresh the transparency proofs it staples to its evidence (on its timer, with backoff
    after a failure): how it went, and how fresh the proofs it staples are afterwards."""

    kind: ClassVar[str] = "proofs_refreshed"
    node_id: NodeId
    outcome: ProofRefreshOutcome
    proofs: ProofFreshness


@dataclass(frozen=True, slots=True)
class RequestFinished(AuditEvent):
    """One request ended on a node; sizes and durations are buckets, never exact."""

    kind: ClassVar[str] = "request_finished"
    node_id: NodeId
    status: RequestStatus
    prompt_tokens_bucket: TokenBucket
    output_tokens_bucket: TokenBucket
    latency_bucket: LatencyBucket
    ttft_bucket: OptionalLatencyBucket  # None when no token was produced


@dataclass(frozen=True, slots=True)
class BlocksZeroed(AuditEvent):
    """Freed KV blocks were zeroed: a node's tally of the batches its engine steps zeroed.

    A tally spans at least a second and several ended requests (or a minute), so that its exact
    block count does not tell one request's length; `step` is the last engine step it covers.

    `residue_blocks` is how many of the freed blocks a residue check found not
    all-zero afterwards: 0 on a healthy node, anything else is a red line.
    """

    kind: ClassVar[str] = "blocks_zeroed"
    node_id: NodeId
    step: Counter
    blocks: Counter
    residue_blocks: Counter

    def __post_init__(self) -> None:
        validate_event(self)
        if self.residue_blocks > self.blocks:
            raise AuditSchemaError(
                "field 'residue_blocks' of BlocksZeroed cannot exceed 'blocks'; "
                "count residue only among the blocks of this batch",
                kind=self.kind, field="residue_blocks",
            )


@dataclass(frozen=True, slots=True)
class RouteDecision(AuditEvent):
    """The gateway routed one request: the client's candidates and the node it chose.

    `chosen` is None when no node was tried (no healthy candidate, or the
    gateway shed load); otherwise it is one of `candidates`.
    """

    kind: ClassVar[str] = "route_decision"
    gateway_id: GatewayId
    candidates: NodeIds
    chosen: OptionalNodeId
    outcome: RouteOutcome
    latency_bucket: LatencyBucket

    def __post_init__(self) -> None:
        validate_event(self)
        if self.chosen is not None and self.chosen not in self.candidates:
            raise AuditSchemaError(
                "field 'chosen' of RouteDecision must be one of 'candidates'; "
                "a gateway can only forward to a node the client encrypted for",
                kind=self.kind, field="chosen",
            )
        if self.chosen is None and self.outcome in (RouteOutcome.OK, RouteOutcome.FAILOVER):
            raise AuditSchemaError(
                "field 'chosen' of RouteDecision must name the node that served an ok or failover route",
                kind=self.kind, field="chosen",
            )


@dataclass(frozen=True, slots=True)
class NodeAdmitted(AuditEvent):
    """A gateway admitted a node to its directory after verifying its evidence."""

    kind: ClassVar[str] = "node_admitted"
    gateway_id: GatewayId
    node_id: NodeId
    capacity: Capacity


@dataclass(frozen=True, slots=True)
class NodeEvicted(AuditEvent):
    """A gateway removed a node from its directory."""

    kind: ClassVar[str] = "node_evicted"
    gateway_id: GatewayId
    node_id: NodeId
    reason: EvictionReason


@dataclass(frozen=True, slots=True)
class TokenDecisions(AuditEvent):
    """A gateway's tally of the Privacy Pass tokens it accepted and refused under one issuer key.

    The gateway emits its tallies every minute and when it stops, never per request, so no event
    dates a request more finely than the `period_s` seconds that end at the event's timestamp.
    `key_id` is one of the key ids the policy lists, or null for the refusals that name none
    (missing, malformed or unknown key); nothing about a token itself is ever recorded.
    """

    kind: ClassVar[str] = "token_decisions"
    gateway_id: GatewayId
    key_id: OptionalIssuerKeyId
    period_s: TallyPeriod
    accepted: Counter
    refused: Annotated[Mapping[str, int], Tally(TokenRefusal, "tokens refused, by reason")]

    def __post_init__(self) -> None:
        validate_event(self)
        keyed = self.key_id is not None
        if any(self.refused[reason] for reason in TokenRefusal if (reason in UNKEYED_REFUSALS) == keyed):
            raise AuditSchemaError(
                "field 'refused' of TokenDecisions counts missing, malformed and unknown_key refusals under "
                "a null key_id only, and every other refusal under its listed key",
                kind=self.kind, field="refused",
            )
        if not keyed and self.accepted:
            raise AuditSchemaError("field 'accepted' of TokenDecisions must be 0 when key_id is null; "
                                   "an accepted token names a listed key", kind=self.kind, field="accepted")


@dataclass(frozen=True, slots=True)
class EventsDropped(AuditEvent):
    """A sink's queue was full and it dropped `dropped` events since its last report.

    Sinks drop rather than block so that inference never waits on audit I/O;
    this event makes every drop visible in the audit stream itself.
    """

    kind: ClassVar[str] = "events_dropped"
    dropped: Counter


EVENT_TYPES: Mapping[str, type[AuditEvent]] = types.MappingProxyType({
    cls.kind: cls
    for cls in (NodeStarted, NodeStopped, EvidenceRefreshed, RequestFinished, BlocksZeroed,
                RouteDecision, NodeAdmitted, NodeEvicted, TokenDecisions, EventsDropped, ProofsRefreshed)
})


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One event as stored: the event and its coarse timestamp (whole seconds)."""

    ts: int
    event: AuditEvent


# Per event class: (field name, spec, "Class.field" for error messages), computed once.
_FIELD_SPECS: dict[type[AuditEvent], tuple[tuple[str, FieldSpec, str], ...]] = {}


def _specs_with_names(cls: type[AuditEvent]) -> tuple[tuple[str, FieldSpec, str], ...]:
    specs = _FIELD_SPECS.get(cls)
    if specs is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        specs = tuple((f.name, _spec_of(hints[f.name], cls, f.name), f"{cls.__name__}.{f.name}")
                      for f in dataclasses.fields(cls))
        _FIELD_SPECS[cls] = specs
    return specs


def field_specs(cls: type[AuditEvent]) -> tuple[tuple[str, FieldSpec], ...]:
    """The (name, spec) pairs of an event class, in declaration order."""
    return tuple((name, spec) for name, spec, _ in _specs_with_names(cls))


def _spec_of(annotation: Any, cls: type, name: str) -> FieldSpec:
    if typing.get_origin(annotation) is typing.Annotated:
        return annotation.__metadata__[0]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return Choice(annotation, (annotation.__doc__ or annotation.__name__).strip())
    # A field declared without a spec is a bug in this module, caught on first use.
    raise TypeError(f"{cls.__name__}.{name} has no audit field spec")


def validate_event(event: AuditEvent) -> None:
    """Check every field of `event` against its spec, normalising enums and tuples in place.

    Raises `AuditSchemaError` naming the first offending field, for events of
    unknown types too (a subclass could otherwise smuggle in extra fields).
    """
    cls = type(event)
    specs = _FIELD_SPECS.get(cls)  # holds registered event classes only
    if specs is None:
        _require_event_type(cls)
        specs = _specs_with_names(cls)
    for name, spec, where in specs:
        value = getattr(event, name)
        checked = spec.check(value, where)
        if checked is not value:
            object.__setattr__(event, name, checked)


def _require_event_type(cls: type) -> None:
    kind = getattr(cls, "kind", None)
    if not isinstance(kind, str) or EVENT_TYPES.get(kind) is not cls:
        raise AuditSchemaError(
            f"{cls.__name__} is not an audit event type of schema {SCHEMA_VERSION}; "
            "use one of the classes in audit.events",
        )


def coarse_ts(now: float) -> int:
    """`now` (seconds since the epoch) floored to `TS_RESOLUTION_S`."""
    if not math.isfinite(now) or now < 0:
        raise AuditSchemaError("a timestamp must be finite seconds since the epoch", field="ts")
    return int(now) // TS_RESOLUTION_S * TS_RESOLUTION_S


def to_record(event: AuditEvent, now: float) -> dict[str, Any]:
    """The JSON object stored for `event` emitted at `now` (validated again first)."""
    validate_event(event)
    return record_of_validated(event, now)


def record_of_validated(event: AuditEvent, now: float) -> dict[str, Any]:
    """`to_record` for an event that `validate_event` has just accepted (a sink's writer)."""
    record: dict[str, Any] = {"schema": SCHEMA_VERSION, "kind": event.kind, "ts": coarse_ts(now)}
    for name, _, _ in _specs_with_names(type(event)):
        record[name] = _to_json(getattr(event, name))
    return record


def _to_json(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {name: _to_json(item) for name, item in value.items()}
    if isinstance(value, tuple):
        return [_to_json(item) for item in value]
    return value


def from_record(record: Any) -> AuditRecord:
    """Parse a stored JSON object back into an `AuditRecord`, validating everything.

    Unknown schema versions, unknown kinds, missing or extra keys and values
    that break a field's spec all raise `AuditSchemaError`.
    """
    if not isinstance(record, dict):
        raise AuditSchemaError("an audit record must be a JSON object")
    if record.get("schema") != SCHEMA_VERSION:
        raise AuditSchemaError(
            f"an audit record must declare schema {SCHEMA_VERSION}; "
            "read it with the release that wrote it", field="schema",
        )
    kind = record.get("kind")
    cls = EVENT_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise AuditSchemaError("an audit record has an unknown kind", field="kind")
    ts = record.get("ts")
    if type(ts) is not int or ts < 0:
        raise AuditSchemaError("field 'ts' must be whole seconds since the epoch", kind=cls.kind, field="ts")
    names = [name for name, _, _ in _specs_with_names(cls)]
    if set(record) != {"schema", "kind", "ts", *names}:
        raise AuditSchemaError(
            f"a {cls.kind} record must have exactly the keys schema, kind, ts, " + ", ".join(names),
            kind=cls.kind,
        )
    return AuditRecord(ts=ts, event=cls(**{name: record[name] for name in names}))
