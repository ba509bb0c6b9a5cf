"""The JSON Schema export: versioned, stored, and in agreement with the Python validation."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import audit
from audit import AuditSchemaError, NodeStopped
from audit.events import SCHEMA_VERSION, to_record
from audit.schema import audit_json_schema, audit_json_schema_text
from tests.test_audit_cli import veil_audit
from tests.test_audit_events import NODE_A, sample_events

VALIDATOR = jsonschema.Draft202012Validator(audit_json_schema())


def test_the_schema_is_a_valid_draft_2020_12_document():
    jsonschema.Draft202012Validator.check_schema(audit_json_schema())


def test_the_stored_schema_of_this_version_matches_the_events():
    """Changing an event without bumping SCHEMA_VERSION (and storing the new document) fails here."""
    stored = Path(audit.__file__).parent / "schemas" / (SCHEMA_VERSION.replace("/", "-") + ".schema.json")
    assert stored.read_text() == audit_json_schema_text()


def test_every_emitted_kind_validates_against_the_schema():
    for event in sample_events():
        VALIDATOR.validate(to_record(event, 1_700_000_000.5))


@pytest.mark.parametrize("change", [
    {"note": "free text"},
    {"node_id": "Hello, this is a prompt"},
    {"reason": "felt like it"},
    {"ts": 1.5},
    {"schema": "veil.audit/2"},
])
def test_the_schema_rejects_what_the_validator_rejects(change):
    record = to_record(NodeStopped(NODE_A, "shutdown"), 5) | change
    assert not VALIDATOR.is_valid(record)


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=70), st.text(alphabet="0123456789abcdefABCDEF\n ", max_size=70)))
def test_schema_and_python_validation_agree_on_node_ids(candidate):
    record = to_record(NodeStopped(NODE_A, "shutdown"), 5) | {"node_id": candidate}
    try:
        NodeStopped(candidate, "shutdown")
        accepted = True
    except AuditSchemaError:
        accepted = False
    assert VALIDATOR.is_valid(record) == accepted


def test_veil_audit_schema_prints_the_schema(capsys):
    assert veil_audit(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == audit_json_schema()
