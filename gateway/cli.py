"""`veil gateway`: run the anonymizing gateway (FastAPI on uvicorn) in front of attested nodes."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from audit.logs import add_operation_options, configure_logging, ensure_logging
from gateway.settings import GatewaySettings
from serving.settings import add_connection_limits

_log = logging.getLogger("veil.server")

DEFAULTS = GatewaySettings()


def register(subparsers: Any) -> None:
    """Add `veil gateway` to the command line."""
    parser = subparsers.add_parser(
        "gateway",
        help="run the anonymizing gateway in front of attested nodes",
        description="Admit nodes whose evidence verifies under the policy, publish the attested directory, "
                    "and relay encrypted requests to a uniformly chosen candidate. No access log is kept.",
    )
    parser.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve on (port 0 picks a free one)")
    parser.add_argument("--node", action="append", default=[], metavar="HOST:PORT",
                        help="a node's gRPC address to admit, repeatable (default: none)")
    parser.add_argument("--node-dns", action="append", default=[], metavar="NAME:PORT",
                        help="a DNS name whose every address is a node (a Kubernetes headless Service), resolved "
                             "again every --dns-refresh-s; repeatable (default: none)")
    parser.add_argument("--dns-refresh-s", type=float, default=DEFAULTS.dns_refresh_s,
                        help="how often to resolve the --node-dns names again")
    parser.add_argument("--policy", default="strict", help="dev, strict or a policy file (default: strict)")
    parser.add_argument("--port-file", type=Path, help="write the chosen port here once serving (default: none, not written)")
    parser.add_argument("--audit", default="none", help="audit sink: stdout, file:PATH or none (default: none)")
    parser.add_argument("--reattest-s", type=float, default=DEFAULTS.reattest_s, help="re-attest admitted nodes this often")
    parser.add_argument("--health-s", type=float, default=DEFAULTS.health_s, help="health-check nodes this often")
    parser.add_argument("--key-grace-s", type=float, default=DEFAULTS.key_grace_s,
                        help="keep routing a node's old id this long after it rotates its key")
    parser.add_argument("--max-in-flight", type=int, default=DEFAULTS.max_in_flight, help="bound on requests in flight")
    parser.add_argument("--max-in-flight-per-node", type=int, default=DEFAULTS.max_in_flight_per_node,
                        help="bound on requests in flight to one node")
    parser.add_argument("--directory-size", type=int, default=DEFAULTS.directory_size,
                        help="publish a larger pool as a random sample of this many nodes, redrawn every minute")
    parser.add_argument("--accept-timeout-s", type=float, default=DEFAULTS.accept_timeout_s,
                        help="how long a node may take to accept a request (it does so before generating); "
                             "past it the answer is 504 and no other node gets the request (default: %(default)s)")
    add_connection_limits(parser)
    parser.add_argument("--keep-alive-s", type=float, default=DEFAULTS.keep_alive_s,
                        help="close an idle connection after this long (default: %(default)s)")
    parser.add_argument("--relay-only", action="append", default=[], metavar="ADDRESS",
                        help="accept requests for nodes (/v1/infer, /v1/nodes/ID/ohttp and /attest) only from this "
                             "relay address or network, repeatable (default: from anyone)")
    parser.add_argument("--allow-registration", action="store_true",
                        help="let nodes ask to join through POST /v1/nodes/register (each is attested first)")
    parser.add_argument("--origin", default="",
                        help="HOST[:PORT] clients reach this gateway by; tokens must be bound to it when the "
                             "policy lists issuer keys (default: none)")
    parser.add_argument("--issuer-directory", default="",
                        help="the token issuer's key directory, a file or http(s) URL (default: none)")
    parser.add_argument("--spent-tokens", default="",
                        help="spent-token store, sqlite:PATH or redis://HOST:PORT/DB (default: this process only)")
    add_operation_options(parser)
    parser.set_defaults(handler=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    """Build the settings and serve until SIGINT/SIGTERM; exit 2 on a bad configuration."""
    from serving.errors import ServingError
    from serving.server import ServerStartError

    configure_logging(args.log_format)
    try:
        settings = GatewaySettings(
            nodes=tuple(args.node), node_dns=tuple(args.node_dns), dns_refresh_s=args.dns_refresh_s,
            policy=args.policy, listen=args.listen, port_file=args.port_file,
            audit=args.audit, allow_registration=args.allow_registration, reattest_s=args.reattest_s,
            health_s=args.health_s, key_grace_s=args.key_grace_s, max_in_flight=args.max_in_flight,
            max_in_flight_per_node=args.max_in_flight_per_node, directory_size=args.directory_size,
            accept_timeout_s=args.accept_timeout_s, header_timeout_s=args.header_timeout_s,
            body_timeout_s=args.body_timeout_s, keep_alive_s=args.keep_alive_s, max_connections=args.max_connections,
            relay_only=tuple(args.relay_only),
            origin=args.origin, issuer_directory=args.issuer_directory, spent_tokens=args.spent_tokens,
        )
        return serve(settings)
    except (ServerStartError, ServingError) as error:
        print(f"veil gateway: cannot start: {error}", file=sys.stderr)
        return 2


def serve(settings: GatewaySettings) -> int:
    """Run the gateway for `settings` until it is stopped; raise ServerStartError on bad configuration."""
    from audit.errors import AuditError
    from gateway.app import create_app
    from policy import PolicyError
    from serving.errors import ServingError
    from serving.server import ServerStartError, serve_app

    ensure_logging()
    try:
        app = create_app(settings)
    except (PolicyError, AuditError, ServingError) as error:
        raise ServerStartError(str(error)) from None
    if app.state.runtime.pool.policy.is_development:
        _log.warning("veil gateway: policy %r admits nodes with SIMULATED attestation; nothing protects user "
                     "data on them. Development only.", app.state.runtime.pool.policy.name)
    return serve_app(app, settings, name="veil gateway")
