"""JSON Schema export of the audit event schema.

The schema is generated from the event classes, and the generated document of
each version is also stored in `audit/schemas/` so that anyone can check audit
files without running Veil. A test compares the two: changing an event means
bumping `SCHEMA_VERSION` and storing the new document beside the old ones.
Adding a kind does not: every record an earlier release wrote still validates
against the new document, and no existing kind reads differently, so the
document of the version is updated in place (a checker holding the earlier
copy sees the new kind as unknown, and fetches the current one).
"""

from __future__ import annotations

import json
from typing import Any

from audit.events import EVENT_TYPES, SCHEMA_VERSION, TS_RESOLUTION_S, AuditEvent, field_specs

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def event_json_schema(cls: type[AuditEvent]) -> dict[str, Any]:
    """The JSON Schema of one event kind's stored record."""
    properties: dict[str, Any] = {
        "schema": {"const": SCHEMA_VERSION},
        "kind": {"const": cls.kind},
        "ts": {"type": "integer", "minimum": 0,
               "description": f"seconds since the epoch, floored to {TS_RESOLUTION_S} s"},
    }
    for name, spec in field_specs(cls):
        properties[name] = spec.json_schema()
    return {
        "title": cls.__name__,
        "description": " ".join((cls.__doc__ or "").split()),
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def audit_json_schema() -> dict[str, Any]:
    """The JSON Schema that every stored audit record (one JSON line) satisfies."""
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": f"urn:veil:schema:{SCHEMA_VERSION}",
        "title": f"Veil audit event ({SCHEMA_VERSION})",
        "description": "One audit event per JSON line. No field can hold free text: every value "
                       "is a number, a bucket label, an enum value or an identifier matching a strict pattern.",
        "oneOf": [{"$ref": f"#/$defs/{kind}"} for kind in EVENT_TYPES],
        "$defs": {kind: event_json_schema(cls) for kind, cls in EVENT_TYPES.items()},
    }


def audit_json_schema_text() -> str:
    """`audit_json_schema()` as stable, indented JSON text (the stored form)."""
    return json.dumps(audit_json_schema(), indent=2, ensure_ascii=True) + "\n"
