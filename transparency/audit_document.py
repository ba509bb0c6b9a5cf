"""`veil audit report transparency`: a monitor's log audit as a report beside the non-targetability one.

The same audit as `veil log audit` (every tile and the root recomputed, consistency with the tree the
auditor saw last, every statement listed), written as `transparency.md` and `transparency.html` in the
report directory. Red lines: a log that fails its audit (tampered, rewritten, rolled back, unreachable),
a release whose code the auditor does not trust, an entry that is no Veil statement, and a key id the
policy accepts that the log never showed. Everything in it is public: digests, key ids, windows.
"""

from __future__ import annotations

import base64
from pathlib import Path

from attestation.transparency.statements import IssuerKeyStatement, NodeKeyStatement, ReleaseStatement
from audit.reports.document import Document, Table, WrittenReport
from transparency.audit import AuditedEntry, AuditReport

STEM = "transparency"
TITLE = "Veil transparency log audit"


def write_transparency_report(report: AuditReport, out_dir: Path) -> WrittenReport:
    """Write the audit's report into `out_dir` (created if needed)."""
    return _written(_document(report), out_dir, passed=not _red_lines(report))


def write_failed_audit(source: str, reason: str, out_dir: Path) -> WrittenReport:
    """Write the report of a log that failed its audit: nothing of it can be listed, the state is unchanged."""
    doc = Document(TITLE)
    doc.red_line(f"the log at {source} failed its audit: {reason}. The auditor's state file was left as it was.")
    return _written(doc, out_dir, passed=False)


def _written(doc: Document, out_dir: Path, passed: bool) -> WrittenReport:
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown, html = doc.write(out_dir, STEM)
    return WrittenReport(markdown=markdown, html=html, images=(), passed=passed)


def _red_lines(report: AuditReport) -> list[str]:
    lines = [f"entry {entry.index}: release {entry.statement.version} runs code the auditor does not trust"
             for entry in report.untrusted_releases if isinstance(entry.statement, ReleaseStatement)]
    lines += [f"entry {entry.index} is not a Veil statement" for entry in report.malformed]
    lines += [f"issuer key {key}: the policy accepts it, the log never showed it"
              for key in report.unlogged_issuer_keys]
    return lines


def _document(report: AuditReport) -> Document:
    doc = Document(TITLE)
    red = _red_lines(report)
    for line in red:
        doc.red_line(line)
    if not red:
        doc.verdict(f"The log {report.origin} is consistent: every tile and the root recomputed from its "
                    f"{report.size} entries, {_since(report)}, nothing flagged.", passed=True)
    doc.heading("Checkpoint")
    doc.paragraph(f"Origin {report.origin}, size {report.size}, root {base64.b64encode(report.root).decode()}; "
                  f"{_since(report)}.")
    doc.paragraph(f"Cosigned by (verified under the witness keys given): {', '.join(report.cosigners) or 'none'}. "
                  f"Other signature lines, not verified: {', '.join(report.unverified) or 'none'}.")
    _statements(doc, report.entries)
    return doc


def _since(report: AuditReport) -> str:
    if report.previous_size is None:
        return "first audit of this log by this auditor (its state file now holds this checkpoint)"
    return f"consistent with the tree of size {report.previous_size} this auditor saw last"


def _statements(doc: Document, entries: list[AuditedEntry]) -> None:
    releases = [entry for entry in entries if isinstance(entry.statement, ReleaseStatement)]
    doc.heading(f"Releases ({len(releases)})")
    doc.table(Table(("entry", "version", "code digest", "policy digest", "models", "verdict"),
                    tuple(_release_row(entry) for entry in releases),
                    frozenset(row for row, entry in enumerate(releases) if entry.trusted is False)))
    node_keys = [entry for entry in entries if isinstance(entry.statement, NodeKeyStatement)]
    doc.heading(f"Node keys ({len(node_keys)})")
    doc.table(Table(("entry", "key configuration digest", "measurement", "valid from", "valid until", "receipt key"),
                    tuple((str(entry.index), entry.statement.key_config_digest, entry.statement.measurement,
                           str(entry.statement.not_before), str(entry.statement.not_after),
                           entry.statement.receipt_key)
                          for entry in node_keys if isinstance(entry.statement, NodeKeyStatement))))
    issuer_keys = [entry for entry in entries if isinstance(entry.statement, IssuerKeyStatement)]
    doc.heading(f"Issuer keys ({len(issuer_keys)})")
    doc.table(Table(("entry", "token key id", "valid from", "valid until"),
                    tuple((str(entry.index), entry.statement.token_key_id, str(entry.statement.not_before),
                           str(entry.statement.not_after))
                          for entry in issuer_keys if isinstance(entry.statement, IssuerKeyStatement))))


def _release_row(entry: AuditedEntry) -> tuple[str, ...]:
    statement = entry.statement
    assert isinstance(statement, ReleaseStatement)
    verdict = {True: "trusted", False: "UNTRUSTED", None: "no trusted list given"}[entry.trusted]
    return (str(entry.index), statement.version, statement.code_digest, statement.policy_digest,
            str(len(statement.model_digests)), verdict)
