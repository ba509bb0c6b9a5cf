"""The typed audit events: every field is validated, nothing can carry free text."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from audit import (
    AuditSchemaError,
    BlocksZeroed,
    EventsDropped,
    EvidenceRefreshed,
    NodeAdmitted,
    NodeEvicted,
    NodeStarted,
    NodeStopped,
    ProofsRefreshed,
    RequestFinished,
    RequestStatus,
    RouteDecision,
    RouteOutcome,
    TokenDecisions,
    TokenRefusal,
    bucket_latency_ms,
    bucket_tokens,
)
from audit.buckets import LATENCY_BUCKET_EDGES_MS, TOKEN_BUCKET_EDGES, token_bucket_lower_bound
from audit.events import EVENT_TYPES, SCHEMA_VERSION, field_specs, from_record, to_record

NODE_A = hashlib.sha256(b"node a").hexdigest()[:32]
NODE_B = hashlib.sha256(b"node b").hexdigest()[:32]
GATEWAY = hashlib.sha256(b"gateway").hexdigest()[:16]
POLICY = hashlib.sha256(b"policy").hexdigest()
ISSUER_KEY = hashlib.sha256(b"issuer key").hexdigest()


def refusals(**counts: int) -> dict[str, int]:
    """A TokenDecisions `refused` object: every reason, 0 unless given."""
    return {reason.value: counts.get(reason.value, 0) for reason in TokenRefusal}


def sample_events() -> list:
    """One valid event of every kind."""
    return [
        NodeStarted(NODE_A, POLICY, "0.1.0", "sim"),
        NodeStopped(NODE_A, "shutdown"),
        EvidenceRefreshed(NODE_A, "ok"),
        RequestFinished(NODE_A, "ok", bucket_tokens(300), bucket_tokens(40), bucket_latency_ms(812.5),
                        bucket_latency_ms(41)),
        BlocksZeroed(NODE_A, step=7, blocks=12, residue_blocks=0),
        RouteDecision(GATEWAY, (NODE_A, NODE_B), NODE_B, "failover", "10-49ms"),
        NodeAdmitted(GATEWAY, NODE_A, capacity=8),
        NodeEvicted(GATEWAY, NODE_B, "evidence_expired"),
        TokenDecisions(GATEWAY, ISSUER_KEY, period_s=60, accepted=41, refused=refusals(spent=2, wrong_challenge=1)),
        EventsDropped(dropped=3),
        ProofsRefreshed(NODE_A, "log_unreachable", "aging"),
    ]


def test_every_kind_has_a_sample_and_round_trips_through_its_record():
    events = sample_events()
    assert {event.kind for event in events} == set(EVENT_TYPES)
    for event in events:
        record = to_record(event, 1_700_000_123.9)
        assert record["schema"] == SCHEMA_VERSION and record["kind"] == event.kind
        assert record["ts"] == 1_700_000_123  # whole seconds, floored
        parsed = from_record(record)
        assert parsed.event == event and parsed.ts == 1_700_000_123


def test_enum_values_given_as_strings_become_members():
    event = RequestFinished(NODE_A, "aborted", "0", "0", "0-9ms", None)
    assert event.status is RequestStatus.ABORTED
    assert RouteDecision(GATEWAY, [NODE_A], NODE_A, "ok", "0-9ms").candidates == (NODE_A,)


SECRET = "my secret prompt"


@pytest.mark.parametrize("build, field", [
    (lambda: NodeStarted(SECRET, POLICY, "0.1.0", "sim"), "node_id"),
    (lambda: NodeStarted(NODE_A, SECRET, "0.1.0", "sim"), "policy_digest"),
    (lambda: NodeStarted(NODE_A, POLICY, "0.1.0 " + SECRET, "sim"), "release"),
    (lambda: NodeStarted(NODE_A, POLICY, "0.1.0", SECRET), "backend"),
    (lambda: NodeStopped(NODE_A, SECRET), "reason"),
    (lambda: RequestFinished(NODE_A, "ok", SECRET, "0", "0-9ms", None), "prompt_tokens_bucket"),
    (lambda: RequestFinished(NODE_A, "ok", "0", "0", "0-9ms", SECRET), "ttft_bucket"),
    (lambda: RouteDecision(GATEWAY, (NODE_A, SECRET), NODE_A, "ok", "0-9ms"), "candidates"),
    (lambda: RouteDecision(SECRET, (NODE_A,), NODE_A, "ok", "0-9ms"), "gateway_id"),
    (lambda: NodeEvicted(GATEWAY, NODE_A, SECRET), "reason"),
])
def test_free_text_is_rejected_naming_the_field_without_echoing_it(build, field):
    with pytest.raises(AuditSchemaError) as caught:
        build()
    assert caught.value.field == field
    assert field in str(caught.value)
    assert SECRET not in str(caught.value) and "secret" not in str(caught.value)


@pytest.mark.parametrize("value", [True, -1, 1.5, "3", None, 2**53])
def test_counters_accept_only_plain_non_negative_ints(value):
    with pytest.raises(AuditSchemaError):
        BlocksZeroed(NODE_A, step=value, blocks=1, residue_blocks=0)


@pytest.mark.parametrize("node_id", [NODE_A.upper(), NODE_A[:15], "a" * 65, NODE_A + "\n", "g" * 16, b"a" * 16])
def test_node_ids_are_strict_lowercase_hex(node_id):
    with pytest.raises(AuditSchemaError):
        NodeStopped(node_id, "shutdown")


@pytest.mark.parametrize("release", ["0.1.0", "1.20.3rc1", "2.0.0.dev4", "1.0.0-rc.2", "1.0.0-beta"])
def test_releases_are_semver_like(release):
    assert NodeStarted(NODE_A, POLICY, release, "nvml").release == release


@pytest.mark.parametrize("release", ["1.0", "v1.0.0", "1.0.0-hello", "1.0.0+build7", "01.0.0", "1.0.0rc"])
def test_releases_cannot_spell_words(release):
    with pytest.raises(AuditSchemaError):
        NodeStarted(NODE_A, POLICY, release, "nvml")


def test_route_decision_consistency():
    with pytest.raises(AuditSchemaError, match="chosen"):
        RouteDecision(GATEWAY, (NODE_A,), NODE_B, "ok", "0-9ms")  # not a candidate
    with pytest.raises(AuditSchemaError, match="chosen"):
        RouteDecision(GATEWAY, (NODE_A,), None, "ok", "0-9ms")  # served by nobody
    with pytest.raises(AuditSchemaError, match="repeated"):
        RouteDecision(GATEWAY, (NODE_A, NODE_A), NODE_A, "ok", "0-9ms")
    with pytest.raises(AuditSchemaError, match="candidates"):
        RouteDecision(GATEWAY, (), None, "no_candidate", "0-9ms")
    shed = RouteDecision(GATEWAY, (NODE_A,), None, "overloaded", "0-9ms")
    assert shed.outcome is RouteOutcome.OVERLOADED and shed.chosen is None


def test_token_decisions_count_each_refusal_under_the_key_it_can_name():
    unkeyed = TokenDecisions(GATEWAY, None, period_s=60, accepted=0, refused=refusals(missing=3, malformed=1))
    assert dict(unkeyed.refused) == refusals(missing=3, malformed=1)
    with pytest.raises(AuditSchemaError, match="accepted"):
        TokenDecisions(GATEWAY, None, period_s=60, accepted=1, refused=refusals())
    with pytest.raises(AuditSchemaError, match="refused"):
        TokenDecisions(GATEWAY, None, period_s=60, accepted=0, refused=refusals(spent=1))
    with pytest.raises(AuditSchemaError, match="refused"):
        TokenDecisions(GATEWAY, ISSUER_KEY, period_s=60, accepted=0, refused=refusals(unknown_key=1))


@pytest.mark.parametrize("refused", [
    refusals() | {"because": 1},  # a reason outside the enum
    {name: count for name, count in refusals().items() if name != "spent"},  # one missing
    refusals(spent=-1),
    refusals() | {"spent": True},
    [0] * len(TokenRefusal),
])
def test_token_refusals_are_one_count_per_reason(refused):
    with pytest.raises(AuditSchemaError, match="refused"):
        TokenDecisions(GATEWAY, ISSUER_KEY, period_s=60, accepted=0, refused=refused)


@pytest.mark.parametrize("change", [{"key_id": ISSUER_KEY[:63]}, {"key_id": ISSUER_KEY.upper()}, {"period_s": 0}])
def test_token_decisions_name_a_whole_key_id_and_a_period_of_a_second_or_more(change):
    sample = TokenDecisions(GATEWAY, ISSUER_KEY, period_s=60, accepted=1, refused=refusals())
    with pytest.raises(AuditSchemaError):
        dataclasses.replace(sample, **change)


def test_token_refusals_are_read_only():
    event = TokenDecisions(GATEWAY, ISSUER_KEY, period_s=60, accepted=1, refused=refusals())
    with pytest.raises(TypeError):
        event.refused["spent"] = 5  # type: ignore[index]


def test_residue_cannot_exceed_the_batch():
    with pytest.raises(AuditSchemaError, match="residue_blocks"):
        BlocksZeroed(NODE_A, step=1, blocks=2, residue_blocks=3)


def test_a_subclass_cannot_smuggle_an_extra_field():
    @dataclasses.dataclass(frozen=True)
    class AnnotatedStop(NodeStopped):
        note: str = "free text"

    with pytest.raises(AuditSchemaError, match="not an audit event type"):
        AnnotatedStop(NODE_A, "shutdown")


def test_events_are_frozen():
    event = NodeStopped(NODE_A, "shutdown")
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.node_id = NODE_B  # type: ignore[misc]


def test_a_tampered_event_is_rejected_at_serialisation():
    event = NodeStopped(NODE_A, "shutdown")
    object.__setattr__(event, "node_id", SECRET)
    with pytest.raises(AuditSchemaError) as caught:
        to_record(event, 0)
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize("change", [
    {"note": "x"},  # extra key
    {"schema": "veil.audit/0"},
    {"kind": "free_text"},
    {"ts": 1.5},
    {"ts": -1},
    {"reason": "because " + SECRET},
])
def test_stored_records_are_validated(change):
    record = to_record(NodeStopped(NODE_A, "shutdown"), 10) | change
    with pytest.raises(AuditSchemaError) as caught:
        from_record(record)
    assert SECRET not in str(caught.value)


def test_stored_records_must_have_every_field():
    record = to_record(NodeStopped(NODE_A, "shutdown"), 10)
    del record["reason"]
    with pytest.raises(AuditSchemaError, match="exactly the keys"):
        from_record(record)


@pytest.mark.parametrize("count, label", [(0, "0"), (1, "1-15"), (15, "1-15"), (16, "16-63"),
                                          (1023, "256-1023"), (1024, "1024-4095"), (10**9, "16384+")])
def test_token_buckets(count, label):
    assert bucket_tokens(count) == label


@pytest.mark.parametrize("ms, label", [(0, "0-9ms"), (9.99, "0-9ms"), (10, "10-49ms"), (999.9, "500-999ms"),
                                       (1000, "1-2.4s"), (29_999, "10-29s"), (86_400_000, "30s+")])
def test_latency_buckets(ms, label):
    assert bucket_latency_ms(ms) == label


@pytest.mark.parametrize("bad", [-1, True, 1.0, "5"])
def test_token_bucket_rejects_non_counts(bad):
    with pytest.raises(AuditSchemaError):
        bucket_tokens(bad)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "5", None])
def test_latency_bucket_rejects_non_durations(bad):
    with pytest.raises(AuditSchemaError):
        bucket_latency_ms(bad)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=10**12))
def test_every_count_falls_in_exactly_its_bucket(count):
    label = bucket_tokens(count)
    lowers = [lower for _, lower in TOKEN_BUCKET_EDGES]
    index = [name for name, _ in TOKEN_BUCKET_EDGES].index(label)
    assert token_bucket_lower_bound(label) <= count
    assert index == len(lowers) - 1 or count < lowers[index + 1]


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0, max_value=1e9))
def test_every_latency_falls_in_exactly_its_bucket(ms):
    label = bucket_latency_ms(ms)
    names = [name for name, _ in LATENCY_BUCKET_EDGES_MS]
    lowers = [lower for _, lower in LATENCY_BUCKET_EDGES_MS]
    index = names.index(label)
    assert lowers[index] <= ms and (index == len(lowers) - 1 or ms < lowers[index + 1])


def _string_fields() -> list[tuple[type, str]]:
    samples = {event.kind: event for event in sample_events()}
    return [(cls, name) for cls in EVENT_TYPES.values() for name, _ in field_specs(cls)
            if isinstance(getattr(samples[cls.kind], name), str)]


STRING_FIELDS = _string_fields()


@pytest.mark.parametrize("cls, name", STRING_FIELDS, ids=[f"{c.kind}.{n}" for c, n in STRING_FIELDS])
@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=80))
def test_no_string_field_accepts_text(cls, name, text):
    """Whatever string is offered, an accepted value is a short token of [0-9a-z._+-]
    (no spaces, capitals, punctuation or non-ASCII, at most 64 characters), and a
    rejection reads the same whatever the value was, so it cannot echo it."""
    sample = {event.kind: event for event in sample_events()}[cls.kind]
    try:
        event = dataclasses.replace(sample, **{name: text})
    except AuditSchemaError as error:
        # Refused for its form ("?"), or, for a well-formed value, by a rule between fields (route_decision's
        # chosen node must be one of its candidates): either way one of the messages fixed values give.
        assert str(error) in {_refusal(sample, name, fixed) for fixed in ("?", "0" * 16)}
        return
    value = str(getattr(event, name))
    assert len(value) <= 64
    assert all(ch in "0123456789abcdefghijklmnopqrstuvwxyz._+-" for ch in value)


def _refusal(sample, name: str, value: str) -> str | None:
    try:
        dataclasses.replace(sample, **{name: value})
    except AuditSchemaError as error:
        return str(error)
    return None


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(sample=st.sampled_from(sample_events()), data=st.data())
def test_hostile_records_fail_only_with_schema_errors(sample, data):
    """Any JSON value in any key of a stored record: either a valid record or AuditSchemaError, never a crash."""
    record = to_record(sample, 100)
    key = data.draw(st.sampled_from(sorted(record)))
    record[key] = data.draw(JSON_VALUES)
    try:
        parsed = from_record(record)
    except AuditSchemaError:
        return
    assert to_record(parsed.event, parsed.ts) == record
