"""`veil relay`: run an OHTTP relay in front of one gateway, apart from the gateway's operator."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from audit.logs import add_operation_options, configure_logging
from serving.settings import MAX_BODY_BYTES, MAX_IN_FLIGHT, add_connection_limits


def register(subparsers: Any) -> None:
    """Add `veil relay` to the command line."""
    parser = subparsers.add_parser(
        "relay",
        help="run an OHTTP relay that keeps client addresses from a gateway",
        description="Forward encrypted requests (/v1/infer, /v1/nodes/ID/ohttp, /v1/nodes/ID/attest) and the "
                    "directory (/v1/nodes) to one gateway, with no client header but a Privacy Pass token, no "
                    "client address and nothing added; stream answers back as they come. No access log is kept. "
                    "Run it apart from the gateway's operator: whoever runs both can link addresses to requests.",
    )
    parser.add_argument("--gateway", required=True, metavar="URL", help="the gateway to forward to (https://HOST[:PORT])")
    parser.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT to serve on (port 0 picks a free one)")
    parser.add_argument("--port-file", type=Path, help="write the chosen port here once serving (default: none, not written)")
    parser.add_argument("--max-in-flight", type=int, default=MAX_IN_FLIGHT,
                        help="past this many requests in flight, answer 503 with Retry-After")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                        help="answer 413 to a larger request body")
    parser.add_argument("--answer-timeout-s", type=float, default=600.0,
                        help="end an answer the gateway pauses within for longer")
    parser.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                        help="serve Prometheus metrics on HOST:PORT, a listener apart from --listen that clients "
                             "should not reach (default: none, no metrics)")
    add_connection_limits(parser)
    add_operation_options(parser)
    parser.set_defaults(handler=run_relay)


def run_relay(args: argparse.Namespace) -> int:
    """Build the relay's settings and serve until SIGINT/SIGTERM; exit 2 on a bad configuration."""
    from relay.app import RelaySettings, serve_relay
    from serving.errors import ServingError
    from serving.server import ServerStartError

    configure_logging(args.log_format)
    try:
        settings = RelaySettings(
            gateway_url=args.gateway, listen=args.listen, port_file=args.port_file, max_in_flight=args.max_in_flight,
            max_body_bytes=args.max_body_bytes, answer_timeout_s=args.answer_timeout_s,
            header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
            max_connections=args.max_connections, metrics_listen=args.metrics_listen,
        )
        return serve_relay(settings)
    except (ServerStartError, ServingError) as error:
        print(f"veil relay: cannot start: {error}", file=sys.stderr)
        return 2
