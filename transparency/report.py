"""What `veil log audit` prints: every statement of the log, releases outside the trusted list flagged."""

from __future__ import annotations

import base64

from attestation.transparency.statements import IssuerKeyStatement, NodeKeyStatement, ReleaseStatement
from transparency.audit import AuditedEntry, AuditReport


def print_report(report: AuditReport) -> int:
    """Print the report; 0 when nothing is flagged, 1 when a release is untrusted, an entry malformed or an
    issuer key of the policy unlogged."""
    since = "first audit" if report.previous_size is None else f"consistent with size {report.previous_size}"
    print(f"log {report.origin}: {report.size} entries, root {base64.b64encode(report.root).decode()} ({since})")
    print(f"cosigned by: {', '.join(report.cosigners) or 'no witness whose key was given'}")
    if report.unverified:
        print(f"other signature lines (not verified, no key given): {', '.join(report.unverified)}")
    for entry in report.entries:
        print(describe(entry))
    for key in report.unlogged_issuer_keys:
        print(f"FLAGGED issuer key {key}: the policy accepts it, the log never showed it")
    flagged = len(report.untrusted_releases) + len(report.malformed) + len(report.unlogged_issuer_keys)
    print(f"all tiles and the root recomputed; {flagged} entr{'y' if flagged == 1 else 'ies'} flagged")
    return 1 if flagged else 0


def describe(entry: AuditedEntry) -> str:
    statement = entry.statement
    if statement is None:
        return f"{entry.index:6d} FLAGGED not a Veil statement"
    if isinstance(statement, ReleaseStatement):
        mark = {True: "trusted", False: "FLAGGED untrusted release", None: "release"}[entry.trusted]
        launches = ", ".join(f"{launch.tee} {launch.measurement[:16]}…" for launch in statement.launch_measurements)
        return (f"{entry.index:6d} {mark} {statement.version} code {statement.code_digest} "
                f"policy {statement.policy_digest[:16]}… models {len(statement.model_digests)}"
                + (f" launch {launches}" if launches else ""))
    if isinstance(statement, NodeKeyStatement):
        return (f"{entry.index:6d} node key {statement.key_config_digest} measurement {statement.measurement[:16]}… "
                f"valid {statement.not_before}-{statement.not_after} receipt key {statement.receipt_key}")
    assert isinstance(statement, IssuerKeyStatement)
    return f"{entry.index:6d} issuer key {statement.token_key_id} valid {statement.not_before}-{statement.not_after}"
