"""Reading stored audit files (JSON lines) back into validated records.

Every line must validate against the schema: a line that does not is either
corruption or an attempt to smuggle data out through the audit channel, so it
stops the reader with its file and line number. The one exception is a last
line without its newline, which is what a crash in the middle of a write
leaves; it is skipped and counted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from audit.errors import AuditReportError, AuditSchemaError
from audit.events import AuditRecord, from_record

# A stored line longer than this cannot be a valid event (64 node ids at most).
MAX_LINE_CHARS = 16_384


@dataclass(frozen=True, slots=True)
class AuditLog:
    """The records of one or more audit files, ordered by timestamp (stable)."""

    records: tuple[AuditRecord, ...]
    files: int
    truncated_tails: int  # files whose unterminated last line was skipped


def read_audit_files(paths: Iterable[str | os.PathLike[str]]) -> AuditLog:
    """Read and validate audit files; records of all files are merged in time order."""
    records: list[AuditRecord] = []
    files = truncated = 0
    for path in paths:
        files += 1
        truncated += _read_one(Path(path), records)
    if files == 0:
        raise AuditReportError("no audit files given; pass one or more JSON lines files")
    records.sort(key=lambda record: record.ts)
    return AuditLog(records=tuple(records), files=files, truncated_tails=truncated)


def _read_one(path: Path, into: list[AuditRecord]) -> int:
    try:
        text = path.read_text(encoding="ascii")
    except OSError as error:
        raise AuditReportError(f"cannot read audit file {path} ({error.strerror})") from None
    except UnicodeDecodeError:
        raise AuditSchemaError(f"{path} is not an audit file: audit records are ASCII JSON") from None
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    into.extend(_parse_lines(path, lines))
    if not tail:
        return 0
    try:
        into.append(_parse_line(tail))
    except AuditSchemaError:
        return 1  # a write cut short by a crash
    return 0


def _parse_lines(path: Path, lines: list[str]) -> Iterator[AuditRecord]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield _parse_line(line)
        except AuditSchemaError as error:
            raise AuditSchemaError(f"{path}, line {number}: {error}", kind=error.kind, field=error.field) from None


def _parse_line(line: str) -> AuditRecord:
    if len(line) > MAX_LINE_CHARS:
        raise AuditSchemaError("a record is longer than any valid audit event")
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise AuditSchemaError("a line is not valid JSON") from None
    return from_record(record)
