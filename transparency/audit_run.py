"""What a monitor gives to audit a log, shared by `veil log audit` and `veil audit report transparency`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transparency.audit import AuditReport


class AuditInputError(ValueError):
    """An auditor's own input (a key, a list, a policy) cannot be used; the log was not looked at."""


def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="the log's directory or http(s) URL")
    parser.add_argument("--log-key", required=True, help="the log's public key (name+hash+base64) or a file holding it")
    parser.add_argument("--state", type=Path, required=True,
                        help="the auditor's own file of the last checkpoint it saw (created on first audit)")
    parser.add_argument("--trusted", type=Path,
                        help="file of code digests (hex, one a line) the auditor trusts; releases of others are "
                             "flagged (default: none, nothing flagged)")
    parser.add_argument("--witness-key", action="append", default=[], metavar="KEY",
                        help="a witness's public key (or a file holding it) whose cosignature to verify, repeatable "
                             "(default: none; cosignatures are then listed unverified)")
    parser.add_argument("--policy", metavar="NAME|FILE",
                        help="a policy (shipped name or file) whose [authorization] issuer_keys must all be logged; "
                             "a listed key id the log never showed is flagged (default: none)")


def run_audit(args: argparse.Namespace) -> AuditReport:
    """Audit `args.source`; raise AuditInputError for the auditor's own input (keys, lists, policy: the log was
    not looked at), TransparencyError for the log."""
    import httpx

    from attestation.transparency.cosignature import CosignatureVerifier
    from attestation.transparency.errors import TransparencyError
    from transparency.audit import audit_log
    from transparency.fetch import source_fetch
    from transparency.keys import read_trusted, read_verifier

    try:
        log_key = read_verifier(args.log_key)
        trusted = read_trusted(args.trusted) if args.trusted else None
        witnesses = tuple(read_verifier(key) for key in args.witness_key)
    except TransparencyError as error:
        raise AuditInputError(f"the auditor's keys or trusted list cannot be used: {error}") from None
    if not all(isinstance(witness, CosignatureVerifier) for witness in witnesses):
        raise AuditInputError("a --witness-key is not a witness key (cosignature/v1, type 0x04)")
    issuer_keys = _policy_issuer_keys(args.policy) if args.policy else ()
    with httpx.Client(timeout=30.0) as client:
        print(f"veil log audit: fetching {args.source}", file=sys.stderr)
        return audit_log(source_fetch(args.source, client), log_key, args.state, trusted, witnesses,  # type: ignore[arg-type]
                         issuer_keys)


def _policy_issuer_keys(name: str) -> tuple[str, ...]:
    from policy import PolicyError, resolve_policy

    try:
        return resolve_policy(name).authorization.issuer_keys
    except PolicyError as error:
        raise AuditInputError(f"the policy {name} cannot be used: {error}") from None
