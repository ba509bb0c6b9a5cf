"""`veil log init|append|serve|audit` for the operator and monitors, and `veil witness`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transparency.audit_run import add_audit_arguments

if TYPE_CHECKING:
    from transparency.audit import AuditedEntry
    from transparency.writer import LogWriter


def register(subparsers: Any) -> None:
    """Add `veil log …` and `veil witness` to the command line."""
    parser = subparsers.add_parser(
        "log", help="the transparency log of releases and node keys: create, append, serve, audit",
        description="A C2SP log (RFC 6962 tree, signed-note checkpoint, static tiles) of release and key "
                    "statements, kept in a directory that any HTTP file server can publish.")
    commands = parser.add_subparsers(dest="log_command", metavar="ACTION", required=True)

    init = commands.add_parser("init", help="create an empty log and its signing key; print the log's public key")
    init.add_argument("directory", type=Path, help="the log's directory (what gets published)")
    init.add_argument("--origin", required=True, help="the log's unique name, e.g. log.example.com/veil")
    init.add_argument("--key", type=Path, required=True, help="where to write the signing key (kept secret, 0600)")
    init.set_defaults(handler=_init)

    append = commands.add_parser("append", help="append release or key statements and sign a new checkpoint")
    append.add_argument("directory", type=Path, help="the log's directory")
    append.add_argument("--key", type=Path, required=True, help="the log's signing key file")
    append.add_argument("--statement", type=Path, action="append", default=[], required=True, metavar="FILE",
                        help="a JSON file holding one statement or a list of them, repeatable")
    append.add_argument("--witness", action="append", default=[], metavar="URL",
                        help="a witness to cosign the new checkpoint, repeatable (default: none)")
    append.set_defaults(handler=_append)

    serve = commands.add_parser("serve", help="serve a log's directory read-only over HTTP")
    serve.add_argument("directory", type=Path, help="the log's directory")
    serve.add_argument("--listen", default="127.0.0.1:8300", help="HOST:PORT to serve on (port 0 picks a free one)")
    serve.add_argument("--port-file", type=Path, help="write the chosen port here once serving (default: none)")
    serve.add_argument("--key", type=Path,
                       help="the log's signing key: also take attested nodes' key statements (POST /add-node-key) "
                            "and give nodes their proofs (default: none, read-only)")
    serve.add_argument("--policy", help="with --key: the policy nodes' evidence must verify under "
                                        "(a shipped name or a file; required with --key, default: none)")
    serve.add_argument("--witness", action="append", default=[], metavar="URL",
                       help="with --key: a witness to cosign each new checkpoint, repeatable (default: none)")
    # apps.DEFAULT_MAX_APPENDS_IN_FLIGHT, spelled out: the apps module loads FastAPI, which parsing need not.
    serve.add_argument("--max-appends-in-flight", type=int, default=4, metavar="N",
                       help="with --key: nodes' appends whose evidence the log verifies at once; one more is "
                            "refused at once with 503 and Retry-After, so that posting evidence cannot tie up the "
                            "log (default: %(default)s)")
    serve.add_argument("--cosign-every-s", type=float, default=300.0,
                       help="with --witness: ask the witnesses again this often, so proofs stay fresh while the "
                            "log does not grow; 0: only when it grows (default: %(default)s)")
    serve.set_defaults(handler=_serve)

    audit = commands.add_parser("audit", help="fetch a whole log, recompute it and list its statements")
    add_audit_arguments(audit)
    audit.add_argument("--receipt", type=Path, default=None,
                       help="also check this node receipt (its JSON, as veil chat --show-receipt prints it) against "
                            "the log's node key statements (default: none)")
    audit.set_defaults(handler=_audit)
    _register_witness(subparsers)


def _register_witness(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "witness", help="run a witness that cosigns a log's checkpoints only when they extend the last one",
        description="Keep the last checkpoint cosigned per log in a state file; cosign (cosignature/v1) a newer "
                    "one only with a valid consistency proof; refuse rollbacks and forks. No access log.")
    parser.add_argument("--key", type=Path, required=True, help="the witness's signing key file")
    parser.add_argument("--new-key", metavar="NAME",
                        help="write a new witness key named NAME to --key, print its public key and exit "
                             "(default: none, serve instead)")
    parser.add_argument("--log", action="append", default=[], metavar="KEY",
                        help="a log's public key (or a file holding it) to follow, repeatable (default: none)")
    parser.add_argument("--state", type=Path, default=Path("witness-state.json"), help="the witness's state file")
    parser.add_argument("--listen", default="127.0.0.1:8310", help="HOST:PORT to serve on (port 0 picks a free one)")
    parser.add_argument("--port-file", type=Path, help="write the chosen port here once serving (default: none)")
    parser.set_defaults(handler=_witness)


def _fail(command: str, message: object, status: int = 2) -> int:
    print(f"veil {command}: {message}", file=sys.stderr)
    return status


def _init(args: argparse.Namespace) -> int:
    from attestation.transparency.errors import TransparencyError
    from attestation.transparency.note import generate_signer
    from transparency.keys import write_key
    from transparency.log import init_log

    try:
        signer = generate_signer(args.origin)
        if (args.directory / "checkpoint").exists():
            return _fail("log init", f"{args.directory} already holds a log; choose an empty directory")
        write_key(args.key, signer.encode())
    except TransparencyError as error:
        return _fail("log init", error)
    try:
        init_log(args.directory, signer)
    except TransparencyError as error:
        args.key.unlink(missing_ok=True)  # ours (written exclusively above): a key without its log only blocks a retry
        return _fail("log init", error)
    print(f"veil log init: created an empty log in {args.directory}; its key is in {args.key}", file=sys.stderr)
    print(signer.verifier.encode())
    return 0


def _append(args: argparse.Namespace) -> int:
    import httpx

    from attestation.transparency.errors import TransparencyError
    from transparency.cosign import cosign_checkpoint
    from transparency.keys import read_signer, read_statements
    from transparency.log import append_entries, read_checkpoint

    try:
        signer = read_signer(args.key)
        entries = [entry for path in args.statement for entry in read_statements(path)]
        if not entries:
            return _fail("log append", "the statement files hold no statement; nothing was appended")
        before = read_checkpoint(args.directory, signer).checkpoint.size
        signed = append_entries(args.directory, signer, entries)
        print(f"veil log append: appended {len(entries)} entries at {before} to {signed.checkpoint.size - 1}; "
              f"checkpoint size {signed.checkpoint.size}", file=sys.stderr)
        if args.witness:
            with httpx.Client(timeout=30.0) as client:
                cosigned = cosign_checkpoint(args.directory, signer, args.witness, client)
            print(f"veil log append: cosigned by {', '.join(sig.name for sig in cosigned)}", file=sys.stderr)
    except TransparencyError as error:
        return _fail("log append", error, 1)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from serving.server import ServerStartError, serve_app
    from serving.settings import ServerSettings
    from attestation.transparency.errors import TransparencyError
    from transparency.apps import log_app
    from transparency.writer import start_cosigner
    from policy import PolicyError

    if not (args.directory / "checkpoint").is_file():
        return _fail("log serve", f"{args.directory} holds no log; run `veil log init` first")
    if args.max_appends_in_flight < 1:
        return _fail("log serve", "--max-appends-in-flight must be at least 1")
    try:
        writer = _writer(args)
        if writer is not None and args.witness:
            start_cosigner(writer, args.cosign_every_s)
        return serve_app(log_app(args.directory, writer, args.max_appends_in_flight),
                         ServerSettings(listen=args.listen, port_file=args.port_file), name="veil log serve")
    except (TransparencyError, PolicyError, ValueError) as error:
        return _fail("log serve", error)
    except ServerStartError as error:
        return _fail("log serve", f"cannot start: {error}")


def _writer(args: argparse.Namespace) -> LogWriter | None:
    """The writer for `--key` (None without it); refuse writer options without a key."""
    from transparency.keys import read_signer
    from transparency.writer import LogWriter
    from policy import resolve_policy

    if args.key is None:
        if args.policy or args.witness:
            raise ValueError("--policy and --witness take effect only with --key (the log's signing key)")
        return None
    if not args.policy:
        raise ValueError("--key needs --policy: the policy appending nodes' evidence must verify under")
    return LogWriter(args.directory, read_signer(args.key), resolve_policy(args.policy), tuple(args.witness))


def _audit(args: argparse.Namespace) -> int:
    from attestation.transparency.errors import TransparencyError
    from transparency.audit_run import AuditInputError, run_audit
    from transparency.report import print_report

    try:
        report = run_audit(args)
    except AuditInputError as error:
        return _fail("log audit", error)
    except TransparencyError as error:
        return _fail("log audit", f"FAILED: {error}", 1)
    status = print_report(report)
    return max(status, _check_receipt(args.receipt, report.entries)) if args.receipt is not None else status


def _check_receipt(path: Path, entries: list[AuditedEntry]) -> int:
    """Exit 0 when the receipt verifies against a node key statement of the audited log, 1 otherwise."""
    from attestation.receipts import ReceiptError
    from transparency.receipt_lookup import logged_statement_for

    try:
        entry, receipt = logged_statement_for(entries, path.read_bytes()[:4096].strip())
    except OSError as error:
        return _fail("log audit", f"cannot read {path}: {error.strerror}")
    except ReceiptError as error:
        return _fail("log audit", f"receipt REFUSED: {error}", 1)
    print(f"receipt verified: signed at {receipt.time} by the receipt key of the node key statement at entry "
          f"{entry.index} (measurement {receipt.measurement[:16]}…)")
    return 0


def _witness(args: argparse.Namespace) -> int:
    from attestation.transparency.cosignature import CosignatureSigner, generate_cosigner
    from attestation.transparency.errors import TransparencyError
    from serving.server import ServerStartError, serve_app
    from serving.settings import ServerSettings
    from transparency.apps import witness_app
    from transparency.keys import read_signer, read_verifier, write_key
    from transparency.witness import Witness

    try:
        if args.new_key:
            signer = generate_cosigner(args.new_key)
            write_key(args.key, signer.encode())
            print(signer.verifier.encode())
            return 0
        signer = read_signer(args.key)
        if not isinstance(signer, CosignatureSigner):
            return _fail("witness", f"{args.key} is not a witness key (cosignature/v1); make one with --new-key")
        if not args.log:
            return _fail("witness", "name at least one log to follow with --log KEY")
        witness = Witness(signer, [read_verifier(key) for key in args.log], args.state)
        print(f"veil witness: {signer.verifier.encode()} follows {len(witness.logs)} log(s)", file=sys.stderr)
        return serve_app(witness_app(witness), ServerSettings(listen=args.listen, port_file=args.port_file),
                         name="veil witness")
    except TransparencyError as error:
        return _fail("witness", error)
    except ServerStartError as error:
        return _fail("witness", f"cannot start: {error}")
