"""The audit package's exception hierarchy.

Messages name what was wrong (a field, a line number, a setting) and what to
do about it; they never repeat the offending value, because a rejected value
is exactly the kind of thing that must not leave a node.
"""

from __future__ import annotations


class AuditError(Exception):
    """Base class of every error raised by `audit`."""


class AuditSchemaError(AuditError, ValueError):
    """An event, a field or a stored record does not fit the typed audit schema."""

    def __init__(self, message: str, *, kind: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.field = field


class AuditSinkError(AuditError):
    """A sink specification is malformed, or a sink could not be opened."""


class AuditReportError(AuditError):
    """Audit files cannot be turned into a report (missing data, unreadable file)."""
