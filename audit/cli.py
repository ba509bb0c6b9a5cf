"""`veil audit ...`: print the event schema, write reports, summarise audit files.

Exit codes: 0 success; 1 a report found a red line (routing rejected, or
residue); 2 the input could not be used (unreadable or invalid audit files).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from audit.records import AuditLog
    from audit.reports.document import WrittenReport

EXIT_OK = 0
EXIT_RED_LINE = 1
EXIT_BAD_INPUT = 2
# Installed with the `reports` extra only, so nodes do not carry them.
REPORT_ONLY_MODULES = ("scipy", "matplotlib")


def register(subparsers: Any) -> None:
    """Add the `audit` command and its subcommands to the `veil` parser."""
    audit = subparsers.add_parser("audit", help="audit events: schema, reports, summaries",
                                  description="Typed audit events of a Veil fleet and the reports built from them.")
    commands = audit.add_subparsers(dest="audit_command", metavar="SUBCOMMAND")
    audit.set_defaults(handler=lambda args: _usage(audit))

    schema = commands.add_parser("schema", help="print the JSON Schema of audit events")
    schema.set_defaults(handler=_schema)

    summary = commands.add_parser("summary", help="one-screen summary of audit files")
    summary.add_argument("files", nargs="+", metavar="FILE", help="audit JSON lines files")
    summary.set_defaults(handler=_summary)

    report = commands.add_parser("report", help="write a report (Markdown, HTML, PNG plots)")
    reports = report.add_subparsers(dest="report_command", metavar="REPORT")
    report.set_defaults(handler=lambda args: _usage(report))
    _register_routes(reports)
    _register_residue(reports)


def report_commands(subparsers: Any) -> Any:
    """The subcommands of `veil audit report`, for a package that adds a report of its own (audit imports
    none: the transparency report is the `transparency` package's, registered after this one)."""
    return _subcommands(_subcommands(subparsers.choices["audit"]).choices["report"])


def _subcommands(parser: argparse.ArgumentParser) -> Any:
    return next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))


def _register_routes(reports: Any) -> None:
    routes = reports.add_parser("routes", help="non-targetability report from gateway route events")
    routes.add_argument("files", nargs="+", metavar="FILE", help="gateway audit JSON lines files")
    routes.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for the report")
    routes.add_argument("--capacity", action="append", default=[], metavar="NODE=CAP",
                        help="capacity of a node, repeatable (default: none; capacities come from node_admitted events)")
    routes.add_argument("--alpha", type=_probability, default=0.01, help="significance level (default 0.01)")
    routes.add_argument("--windows", type=_positive_int, default=10,
                        help="time windows for the p-value plot (default 10)")
    routes.set_defaults(handler=_report_routes)


def _register_residue(reports: Any) -> None:
    residue = reports.add_parser("residue", help="residue report from node zeroing events")
    residue.add_argument("files", nargs="+", metavar="FILE", help="node audit JSON lines files")
    residue.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for the report")
    residue.add_argument("--block-size", type=_positive_int, default=16, help="KV block size in tokens (default 16)")
    residue.set_defaults(handler=_report_residue)


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError("must be a number between 0 and 1, e.g. 0.01")
    return value


def _positive_int(text: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError("must be a whole number of at least 1")
    return int(text)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_BAD_INPUT


def _schema(args: argparse.Namespace) -> int:
    from audit.schema import audit_json_schema_text

    sys.stdout.write(audit_json_schema_text())
    return EXIT_OK


def _summary(args: argparse.Namespace) -> int:
    from audit.errors import AuditError
    from audit.records import read_audit_files
    from audit.summary import format_summary, summarize

    try:
        log = read_audit_files(args.files)
    except AuditError as error:
        return _fail(error)
    sys.stdout.write(format_summary(summarize(log)))
    return EXIT_OK


def parse_capacities(pairs: list[str]) -> dict[str, int]:
    """`NODE=CAP` pairs as a mapping; node ids and capacities are validated like events."""
    from audit.errors import AuditSchemaError
    from audit.fields import CAPACITY, NODE_ID

    capacities = {}
    for pair in pairs:
        node_id, separator, capacity = pair.partition("=")
        if not separator or not capacity.isascii() or not capacity.isdigit():
            raise AuditSchemaError("--capacity takes NODE=CAP with CAP a positive integer", field="capacity")
        capacities[NODE_ID.check(node_id, "--capacity.NODE")] = CAPACITY.check(int(capacity), "--capacity.CAP")
    return capacities


def _report_routes(args: argparse.Namespace) -> int:
    def write(log: AuditLog) -> WrittenReport:
        from audit.reports.routes import build_routes_report, write_routes_report

        capacities = parse_capacities(args.capacity)
        report = build_routes_report(log.records, capacities, alpha=args.alpha, windows=args.windows)
        return write_routes_report(report, args.out)

    return _run_report(args, "routes", write, verdicts=("consistent", "REJECTED"))


def _report_residue(args: argparse.Namespace) -> int:
    def write(log: AuditLog) -> WrittenReport:
        from audit.reports.residue import build_residue_report, write_residue_report

        report = build_residue_report(log.records, block_size=args.block_size, truncated_tails=log.truncated_tails)
        return write_residue_report(report, args.out)

    return _run_report(args, "residue", write, verdicts=("zero residue", "RED LINE"))


def _run_report(args: argparse.Namespace, name: str, write: Callable[[AuditLog], WrittenReport],
                verdicts: tuple[str, str]) -> int:
    """Reads the audit files, writes one report and says where; exit 1 when the report finds a red line."""
    from audit.errors import AuditError
    from audit.records import read_audit_files

    try:
        written = write(read_audit_files(args.files))
    except AuditError as error:
        return _fail(error)
    except OSError as error:
        return _fail(f"cannot write the report into {args.out} ({error.strerror})")
    except ImportError as error:
        return _missing_extra(error)
    print(f"{name} report: {written.markdown} and {written.html} ({verdicts[0] if written.passed else verdicts[1]})")
    return EXIT_OK if written.passed else EXIT_RED_LINE


def _fail(error: Exception | str) -> int:
    print(f"veil audit: {error}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _missing_extra(error: ImportError) -> int:
    if (error.name or "").split(".")[0] not in REPORT_ONLY_MODULES:
        raise error
    print("veil audit: reports need scipy and matplotlib; install them with: pip install 'veil[reports]'",
          file=sys.stderr)
    return EXIT_BAD_INPUT
