"""`veil receipt verify`: a third party checks a receipt against a node's logged key statement.

The receipt (what `veil chat --show-receipt` prints, or the proxy's `veil-receipt` header decoded)
must be signed by the receipt key the statement carries, for its measurement, within its validity
window; `--request` and `--body` check that it covers the bytes its holder shows. Nothing is fetched:
the statement comes from the log (`veil log audit` lists each one) by whatever way the verifier trusts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import hmac
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attestation.transparency.statements import NodeKeyStatement

MAX_FILE_BYTES = 1 << 20


def register(subparsers: argparse._SubParsersAction) -> None:
    receipt = subparsers.add_parser("receipt", help="check a node's signed receipt for an answer")
    commands = receipt.add_subparsers(dest="receipt_command", metavar="COMMAND", required=True)
    verify = commands.add_parser("verify", help="verify a receipt against a node key statement from the log")
    verify.add_argument("receipt", help="file holding the receipt (its canonical JSON), or - for standard input")
    verify.add_argument("--key-statement", required=True, type=Path,
                        help="file holding the node's key statement (a veil.node-key/v1 log entry, JSON)")
    verify.add_argument("--request", type=Path, default=None,
                        help="file holding the Binary HTTP request the receipt must cover (default: none, not checked)")
    verify.add_argument("--body", type=Path, default=None,
                        help="file holding the answer body the receipt must cover (default: none, not checked)")
    verify.set_defaults(handler=_verify)


def _verify(args: argparse.Namespace) -> int:
    from attestation.receipts import ReceiptError, ReceiptMismatchError, verify_against_statement
    from attestation.transparency.errors import StatementFormatError

    try:
        data = sys.stdin.buffer.read(MAX_FILE_BYTES) if args.receipt == "-" else _read(Path(args.receipt))
        statement = _statement(_read(args.key_statement))
        receipt = verify_against_statement(data.strip(), statement)
        for path, signed, what in ((args.request, receipt.request_sha256, "request"),
                                   (args.body, receipt.response_sha256, "body")):
            if path is not None and not hmac.compare_digest(hashlib.sha256(_read(path)).hexdigest(), signed):
                raise ReceiptMismatchError(f"the receipt is for another {what} than the file given")
    except OSError as error:
        print(f"veil receipt verify: cannot read {error.filename}: {error.strerror}", file=sys.stderr)
        return 2
    except (ReceiptError, StatementFormatError) as error:
        print(f"veil receipt verify: REFUSED: {error}", file=sys.stderr)
        return 1
    when = dt.datetime.fromtimestamp(receipt.time, dt.timezone.utc).isoformat()
    print(f"receipt verified: signed by receipt key {receipt.key_id[:16]}… of measurement {receipt.measurement[:16]}… "
          f"at {when}: status {receipt.status}, request sha256 {receipt.request_sha256}, "
          f"body sha256 {receipt.response_sha256}")
    return 0


def _read(path: Path) -> bytes:
    with path.open("rb") as stream:
        return stream.read(MAX_FILE_BYTES)


def _statement(data: bytes) -> NodeKeyStatement:
    from attestation.transparency.errors import StatementFormatError
    from attestation.transparency.statements import NodeKeyStatement, encode_statement, statement_from_value

    try:
        statement = statement_from_value(json.loads(data))
    except (ValueError, RecursionError):
        raise StatementFormatError("the key statement file is not JSON") from None
    if not isinstance(statement, NodeKeyStatement):
        raise StatementFormatError("the key statement file holds another statement than a node key")
    encode_statement(statement)  # its fields' shapes checked as the log checks them
    return statement
