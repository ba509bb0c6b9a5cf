"""`veil attest collect`, `veil attest verify`, `veil attest measure` and `veil attest probe`, and
`veil receipt verify`: a third party checks a node's receipt against its key statement from the log,
with nothing fetched (the statement comes from the log, which `veil log audit` lists, by whatever way
the verifier trusts); `--request` and `--body` check that it covers the bytes its holder shows."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attestation.transparency.statements import NodeKeyStatement

_MARKS = {True: "✓", False: "✗", None: "·"}
MAX_RECEIPT_FILE_BYTES = 1 << 20
SIMULATED_BANNER = "WARNING: SIMULATED attestation evidence: development only, no hardware protects this node"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `veil attest …` to the veil command line."""
    parser = subparsers.add_parser("attest", help="collect or verify attestation evidence")
    commands = parser.add_subparsers(dest="attest_command", metavar="ACTION", required=True)

    collect = commands.add_parser("collect", help="collect an evidence bundle on this machine (JSON to stdout)")
    collect.add_argument("--attestation", choices=("sim", "nvml", "tsm"), default=None,
                         help="evidence backend, named as `veil node --attestation` names it "
                              "(default: probe nvml, then tsm; sim only if asked for)")
    # The name this option had before it was made the same as the node's: kept, not advertised.
    collect.add_argument("--backend", dest="attestation", choices=("sim", "nvml", "tsm"), help=argparse.SUPPRESS)
    collect.add_argument("--nonce", help="32-byte freshness nonce in hex (default: random)")
    collect.add_argument("--model", help="model folder to measure (default: none, measured as no model)")
    collect.add_argument("--policy", help="policy name or file the node runs under (default: dev for sim, else strict)")
    collect.add_argument("--key-config", help="file holding the OHTTP key configuration to bind (default: a throwaway one)")
    collect.set_defaults(handler=_collect)

    verify = commands.add_parser("verify", help="verify an evidence bundle and print every check")
    verify.add_argument("bundle", metavar="BUNDLE|-", help="bundle file, or - for standard input")
    verify.add_argument("--policy", required=True, help="policy name (strict, dev) or file")
    verify.add_argument("--nonce", help="the nonce the evidence must answer, in hex "
                                        "(default: none; then only the evidence's age is checked)")
    verify.set_defaults(handler=_verify)

    measure = commands.add_parser(
        "measure", help="print this release's code, policy and model digests, for a policy's allowlists")
    measure.add_argument("--model", help="model folder the node will serve (default: none, measured as no model)")
    measure.add_argument("--draft-model", default=None,
                         help="the draft model's folder of a node run with --speculative draft:DIR: the model digest "
                              "then covers both (default: none)")
    measure.add_argument("--policy", default="strict", help="policy name or file the node will run under (default: strict)")
    measure.add_argument("--json", action="store_true", help="print JSON instead of text")
    measure.set_defaults(handler=_measure)

    probe = commands.add_parser("probe", help="say which attestation backends work on this machine")
    probe.set_defaults(handler=_probe)
    _register_receipt(subparsers)


def _collect(args: argparse.Namespace) -> int:
    import secrets
    from pathlib import Path

    from attestation.backends import get_backend
    from attestation.errors import AttestationError
    from attestation.measurement import measure
    from policy import PolicyError, resolve_policy
    from policy.shipped import resolve_policy_path

    policy_name = args.policy or ("dev" if args.attestation == "sim" else "strict")
    try:
        nonce = _hex_argument(args.nonce, "--nonce") if args.nonce else secrets.token_bytes(32)
        policy = resolve_policy(policy_name)
        measurement = measure(policy_path=resolve_policy_path(policy_name), model_dir=args.model)
        key_config = Path(args.key_config).read_bytes() if args.key_config else _throwaway_key_config()
        backend = get_backend(args.attestation, policy=policy)
        bundle = backend.collect(key_config, measurement, nonce, _throwaway_receipt_key())
    except (AttestationError, PolicyError, ValueError, OSError) as error:
        print(f"veil attest collect: {error}", file=sys.stderr)
        return 1
    if bundle.backend == "sim":
        print(SIMULATED_BANNER, file=sys.stderr)
    print(bundle.to_json())
    return 0


def _verify(args: argparse.Namespace) -> int:
    from attestation.bundle import EvidenceBundle
    from attestation.errors import AttestationError
    from attestation.verifier import verify_with_report
    from policy import PolicyError, resolve_policy

    try:
        policy = resolve_policy(args.policy)
        expected = _hex_argument(args.nonce, "--nonce") if args.nonce else None
        text = sys.stdin.read() if args.bundle == "-" else open(args.bundle, encoding="utf-8").read()
    except (PolicyError, ValueError, OSError) as error:
        print(f"veil attest verify: {error}", file=sys.stderr)
        return 2
    try:
        bundle = EvidenceBundle.from_json(text)
    except AttestationError as error:
        print(f"{_MARKS[False]} format: {error}")
        return 1
    print(f"{_MARKS[True]} format: {bundle.version}, backend {bundle.backend}")
    report = verify_with_report(bundle, policy, expected_nonce=expected)
    for check in report.checks:
        print(f"{_MARKS[check.passed]} {check.name}: {check.detail}")
    if report.node is None:
        print(f"REFUSED under policy {policy.name!r} at check: {report.error.check}")
        return 1
    if report.node.simulated:
        print(SIMULATED_BANNER, file=sys.stderr)
    print(f"VERIFIED node {report.node.node_id} under policy {policy.name!r}, valid until {report.node.expires_at:.0f}")
    return 0


def _measure(args: argparse.Namespace) -> int:
    import json

    from attestation.errors import AttestationError
    from attestation.measurement import DEFAULT_PACKAGES, measure
    from policy import PolicyError
    from policy.shipped import resolve_policy_path

    try:
        measurement = measure(policy_path=resolve_policy_path(args.policy), model_dir=args.model,
                              draft_dir=args.draft_model)
    except (AttestationError, PolicyError, OSError) as error:
        print(f"veil attest measure: {error}", file=sys.stderr)
        return 1
    digests = {"code_digest": measurement.code_digest.hex(), "policy_digest": measurement.policy_digest.hex(),
               "model_digest": measurement.model_digest.hex(), "measurement": measurement.digest().hex()}
    if args.json:
        print(json.dumps(digests, indent=2))
        return 0
    print(f"code         {digests['code_digest']}  (packages {', '.join(sorted(DEFAULT_PACKAGES))})")
    print(f"policy       {digests['policy_digest']}  ({args.policy})")
    draft = f" with draft model {args.draft_model}" if args.draft_model else ""
    print(f"model        {digests['model_digest']}  ({args.model or 'no model'}{draft})")
    print(f"measurement  {digests['measurement']}  (what evidence binds)")
    print("\nTo admit this code and model under a policy, list them in its file (the policy's own digest")
    print("then changes; clients verify nodes with that same file):")
    print(f'  [attestation]\n  allowed_code_digests = ["{digests["code_digest"]}"]')
    print(f'  [engine]\n  allowed_model_digests = ["{digests["model_digest"]}"]')
    return 0


def _probe(args: argparse.Namespace) -> int:
    from attestation.backends.nvml import load_nvml, nvml_status
    from attestation.backends.tsm import TSM_REPORT_ROOT, tsm_available
    from attestation.errors import AttestationError

    try:
        status = nvml_status(load_nvml())
        verdict = "ready" if status.production_ready else "NOT in production CC mode"
        print(f"nvml: {status.describe()} ({verdict})")
    except AttestationError as error:
        print(f"nvml: {error}")
    print(f"tsm: {'available' if tsm_available() else f'unavailable ({TSM_REPORT_ROOT} is missing)'}")
    print("sim: always available (development only)")
    return 0


def _hex_argument(text: str, flag: str) -> bytes:
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{flag} must be hexadecimal") from None
    if len(value) != 32:
        raise ValueError(f"{flag} must be 32 bytes (64 hex digits)")
    return value


def _throwaway_receipt_key() -> bytes:
    # As for the key configuration: the signing half is dropped, nothing can be signed under it.
    from attestation.receipts import ReceiptSigner

    return ReceiptSigner.generate().public_key


def _throwaway_key_config() -> bytes:
    # The private key is dropped at once: such a bundle demonstrates evidence, no node can use it.
    from ohttp.keys import generate_key_pair

    return generate_key_pair(0).config.encode()


def _register_receipt(subparsers: argparse._SubParsersAction) -> None:
    """Add `veil receipt verify`: a third party checks a node's receipt against its logged key statement."""
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
    verify.set_defaults(handler=_receipt_verify)


def _receipt_verify(args: argparse.Namespace) -> int:
    import datetime as dt
    import hashlib
    import hmac

    from attestation.receipts import ReceiptError, ReceiptMismatchError, verify_against_statement
    from attestation.transparency.errors import StatementFormatError

    try:
        data = (sys.stdin.buffer.read(MAX_RECEIPT_FILE_BYTES) if args.receipt == "-"
                else _read_bounded(Path(args.receipt)))
        statement = _key_statement(_read_bounded(args.key_statement))
        receipt = verify_against_statement(data.strip(), statement)
        for path, signed, what in ((args.request, receipt.request_sha256, "request"),
                                   (args.body, receipt.response_sha256, "body")):
            if path is not None and not hmac.compare_digest(hashlib.sha256(_read_bounded(path)).hexdigest(), signed):
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


def _read_bounded(path: Path) -> bytes:
    with path.open("rb") as stream:
        return stream.read(MAX_RECEIPT_FILE_BYTES)


def _key_statement(data: bytes) -> NodeKeyStatement:
    import json

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
