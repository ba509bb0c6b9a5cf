"""`veil issuer`: run the Privacy Pass token issuer (FastAPI on uvicorn), or add a signing key."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from audit.logs import add_log_format, configure_logging
from serving.settings import ServerSettings, add_connection_limits

if TYPE_CHECKING:
    from issuer.keys import IssuerKeyring


def register(subparsers: Any) -> None:
    """Add `veil issuer` to the command line."""
    parser = subparsers.add_parser(
        "issuer",
        help="run the Privacy Pass token issuer for the gateway's anonymous authorization",
        description="Authenticate accounts by JWT, count their tokens against a quota and blindly sign "
                    "token requests (RFC 9578 type 2). Keeps per-account counts only; no access log.",
    )
    parser.add_argument("--config", type=Path, default=Path("issuer.toml"),
                        help="issuer configuration file (TOML); its [serve] table may hold this command's other "
                             "options (keys are the long options without dashes), which flags override")
    parser.add_argument("--keys", type=Path, default=Path("issuer-keys"), help="directory of token-key-<not_before>.pem files")
    parser.add_argument("--listen", default="127.0.0.1:8100", help="HOST:PORT to serve on (port 0 picks a free one)")
    parser.add_argument("--port-file", type=Path, help="write the chosen port here once serving (default: none, not written)")
    parser.add_argument("--add-key-not-before", type=int, metavar="UNIX_TIME",
                        help="generate a signing key valid from UNIX_TIME (0: now), print its key id and exit "
                             "(default: none, serve instead)")
    _add_transparency(parser)
    add_connection_limits(parser)
    add_log_format(parser)
    parser.set_defaults(handler=run_issuer, config_table="serve")


def _add_transparency(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transparency-log", type=Path, metavar="DIR",
                        help="the operator's transparency log directory: log each key this issuer publishes "
                             "(current and next) there before serving (default: none, keys are not logged)")
    parser.add_argument("--transparency-log-key", type=Path, metavar="FILE",
                        help="the log's signing key file (required with --transparency-log; default: none)")
    parser.add_argument("--transparency-witness", action="append", default=[], metavar="URL",
                        help="a witness to cosign the log's checkpoint after a key is logged, repeatable "
                             "(default: none)")
    parser.add_argument("--transparency-lifetime-s", type=int, default=90 * 86400,
                        help="the validity window a key is logged with, from its not-before, in seconds")


def run_issuer(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, or add a key; exit 2 on a bad configuration."""
    from serving.errors import ServingError
    from issuer.app import create_issuer_app
    from issuer.config import load_config
    from issuer.keys import add_key, load_keyring
    from serving.server import ServerStartError, serve_app

    try:
        if args.add_key_not_before is not None:
            not_before = args.add_key_not_before or int(time.time())
            try:
                key = add_key(args.keys, not_before)
            except OSError as error:
                raise ServerStartError(f"cannot write a key in {args.keys} ({error.strerror})") from None
            print(f"veil issuer: added token key {key.token_key.key_id.hex()} valid from {not_before}; "
                  "list this id in the gateway policy's [authorization] issuer_keys")
            return 0
        config = load_config(args.config)
        keyring = load_keyring(args.keys)
        configure_logging(args.log_format)
        if args.transparency_log is not None:
            _log_keys(args, keyring)
        for dated in keyring.published(time.time()):
            logging.getLogger("veil.issuer").info("veil issuer: publishing token key %s valid from %s",
                                                  dated.key.token_key.key_id.hex(), dated.not_before)
        settings = ServerSettings(listen=args.listen, port_file=args.port_file, header_timeout_s=args.header_timeout_s,
                                  body_timeout_s=args.body_timeout_s, max_connections=args.max_connections)
        return serve_app(create_issuer_app(config, keyring), settings, name="veil issuer")
    except (ServerStartError, ServingError) as error:
        print(f"veil issuer: cannot start: {error}", file=sys.stderr)
        return 2


def _log_keys(args: argparse.Namespace, keyring: IssuerKeyring) -> None:
    """Log every key about to be published that the log lacks; a key that cannot be logged is not served."""
    import httpx

    from attestation.transparency.errors import TransparencyError
    from issuer.transparency import log_issuer_keys
    from serving.server import ServerStartError
    from transparency.cosign import cosign_checkpoint
    from transparency.keys import read_signer

    if args.transparency_log_key is None or args.transparency_lifetime_s < 1:
        raise ServerStartError("--transparency-log needs --transparency-log-key (the log's signing key) and a "
                                "positive --transparency-lifetime-s")
    try:
        signer = read_signer(args.transparency_log_key)
        logged = log_issuer_keys(args.transparency_log, signer, keyring.published(time.time()),
                                 args.transparency_lifetime_s)
        if logged and args.transparency_witness:
            with httpx.Client(timeout=30.0) as client:
                cosign_checkpoint(args.transparency_log, signer, args.transparency_witness, client)
    except TransparencyError as error:
        raise ServerStartError(f"cannot log the token keys in {args.transparency_log}: {error}") from None
    for statement in logged:
        logging.getLogger("veil.issuer").info("veil issuer: logged token key %s in %s", statement.token_key_id,
                                              args.transparency_log)
