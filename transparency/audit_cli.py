"""`veil audit report transparency`: the monitor's log audit as a report, beside `veil audit report routes`.

Exit codes as every `veil audit report`: 0 passed, 1 a red line (the log failed its audit, or
something is flagged), 2 the auditor's own input could not be used or the report not written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from audit.cli import EXIT_BAD_INPUT, EXIT_OK, EXIT_RED_LINE, report_commands
from transparency.audit_run import add_audit_arguments


def register(subparsers: Any) -> None:
    """Add `transparency` to `veil audit report` (registered by audit.cli before this)."""
    parser = report_commands(subparsers).add_parser(
        "transparency", help="transparency log report: the log audited, its releases and keys listed",
        description="Audit a transparency log as `veil log audit` does and write transparency.md and "
                    "transparency.html, e.g. into the directory of the non-targetability report.")
    add_audit_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for the report")
    parser.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from attestation.transparency.errors import TransparencyError
    from transparency.audit_document import write_failed_audit, write_transparency_report
    from transparency.audit_run import AuditInputError, run_audit

    try:
        try:
            written = write_transparency_report(run_audit(args), args.out)
        except TransparencyError as error:
            written = write_failed_audit(args.source, str(error), args.out)
    except AuditInputError as error:
        print(f"veil audit: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as error:
        print(f"veil audit: cannot write the report into {args.out} ({error.strerror})", file=sys.stderr)
        return EXIT_BAD_INPUT
    verdict = "consistent" if written.passed else "RED LINE"
    print(f"transparency report: {written.markdown} and {written.html} ({verdict})")
    return EXIT_OK if written.passed else EXIT_RED_LINE
