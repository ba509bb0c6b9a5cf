"""The subcommands of `veil` that use the SDK or run a local fleet: chat, up, proxy and demo.

Heavy modules (the SDK, the fleet, uvicorn) are imported inside the handlers
so that `veil --help` stays quick.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from veil.route_report import describe_route

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
GATEWAY_ENV = "VEIL_GATEWAY"


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_chat(subparsers)
    _register_up(subparsers)
    _register_proxy(subparsers)
    demo = subparsers.add_parser("demo", help="start a local fleet, send encrypted requests, show what was verified")
    demo.add_argument("--nodes", type=int, default=3, help="node processes to start (default: 3)")
    demo.add_argument("--model", type=Path, default=None,
                      help="Hugging Face model folder (default: the shipped trained model, stories260K)")
    demo.add_argument("--tokens", action=argparse.BooleanOptionalAction, default=True,
                      help="run a token issuer and spend one Privacy Pass token per request")
    demo.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                      help="send every request through an OHTTP relay; the gateway takes requests from it only")
    demo.set_defaults(handler=_demo)


def _register_chat(subparsers: argparse._SubParsersAction) -> None:
    chat = subparsers.add_parser("chat", help="ask a question through a gateway, attested and end-to-end encrypted")
    chat.add_argument("prompt", help="the message to send")
    _add_gateway_arguments(chat)
    chat.add_argument("--model", default=None, help="model id (default: the first one a verified node lists)")
    chat.add_argument("--show-attestation", action="store_true", help="print what was verified about each candidate")
    chat.add_argument("--show-receipt", action="store_true",
                      help="print the node's verified receipt for the answer, one line of JSON after it "
                           "(for `veil receipt verify`)")
    chat.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="print the answer as it comes")
    chat.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    chat.add_argument("--temperature", type=float, default=None, help="sampling temperature, 0 = greedy (default: the node's)")
    chat.add_argument("--seed", type=int, default=None,
                      help="sampling seed: the same seed gives the same answer (default: none, a fresh random draw)")
    chat.set_defaults(handler=_chat)


def _register_up(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="run a local fleet: a gateway and N nodes on loopback (SIMULATED attestation)")
    up.add_argument("--nodes", type=int, default=3, help="node processes to start (default: 3)")
    up.add_argument("--gateway-port", type=int, default=8000, help="loopback port of the gateway (default: 8000; 0 picks one)")
    up.add_argument("--capacity", type=int, default=8,
                    help="concurrent requests each node declares, at most the policy's max_node_capacity (default: 8)")
    up.add_argument("--model", type=Path, default=None,
                    help="Hugging Face model folder (default: the shipped trained model, stories260K)")
    up.add_argument("--workdir", type=Path, default=None, help="where logs and audit files go (default: a temporary folder)")
    up.add_argument("--relay", action=argparse.BooleanOptionalAction, default=False,
                    help="run an OHTTP relay in front of the gateway and print its URL for clients; the gateway "
                         "then takes requests for nodes from the relay only (default: off)")
    up.add_argument("--transparency", action=argparse.BooleanOptionalAction, default=False,
                    help="run a transparency log and two witnesses; nodes log their keys and staple proofs, and the "
                         "fleet's policy (printed) requires a quorum of both (default: off)")
    up.set_defaults(handler=_up)


def _register_proxy(subparsers: argparse._SubParsersAction) -> None:
    proxy = subparsers.add_parser("proxy", help="a local OpenAI-compatible server forwarding through the SDK")
    proxy.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT to serve on (default: 127.0.0.1:8080)")
    _add_gateway_arguments(proxy)
    proxy.set_defaults(handler=_proxy)


def _add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", default=os.environ.get(GATEWAY_ENV, DEFAULT_GATEWAY),
                        help=f"gateway URL (default: ${GATEWAY_ENV} or {DEFAULT_GATEWAY})")
    parser.add_argument("--policy", default="strict",
                        help="policy to verify nodes with: strict, dev (simulated evidence, development only) or a file")
    parser.add_argument("--candidates", type=int, default=None,
                        help="nodes to encrypt each request to, K (default: the policy's routing.candidates, "
                             "which is also the most allowed)")
    parser.add_argument("--fresh-evidence", action="store_true",
                        help="ask each candidate for evidence over this client's own nonce on every request")


# ----- veil chat ---------------------------------------------------------------------------------


def _chat(args: argparse.Namespace) -> int:
    from client.errors import VeilClientError
    from client.sdk import Client
    from policy import PolicyError

    try:
        with Client(args.gateway, policy=args.policy, candidates=args.candidates, fresh_evidence=args.fresh_evidence) as client:
            _warn_if_development(client.policy)
            model = args.model or client.models.list().data[0].id
            route, receipt = _ask(client, model, args)
    except VeilClientError as error:
        print(f"veil chat: {error}", file=sys.stderr)
        return 1
    except (PolicyError, OSError, ValueError) as error:
        print(f"veil chat: {error}", file=sys.stderr)
        return 2
    if args.show_attestation:
        print(describe_route(route))
    if args.show_receipt:
        print(receipt.encode().decode("ascii"))
    return 0


def _ask(client: Any, model: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """Print the answer; return its route and the node's verified receipt for it."""
    messages = [{"role": "user", "content": args.prompt}]
    options = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    if not args.stream:
        answer = client.chat.completions.create(model=model, messages=messages, **options)
        print(answer.choices[0].message.content)
        return answer.route, answer.receipt
    with client.chat.completions.create(model=model, messages=messages, stream=True, **options) as stream:
        for chunk in stream:
            for choice in chunk.choices:
                sys.stdout.write(choice.delta.content or "")
                sys.stdout.flush()
        sys.stdout.write("\n")
        return stream.route, stream.receipt


def _warn_if_development(policy: Any) -> None:
    from client.transparency import without_transparency_warning

    if policy.attestation.allow_simulated:
        print(f"WARNING: policy {policy.name!r} accepts SIMULATED attestation: nothing protects these nodes. "
              "Development only.", file=sys.stderr)
    if (warning := without_transparency_warning(policy)) is not None:
        print(f"WARNING: {warning}.", file=sys.stderr)


# ----- veil up -----------------------------------------------------------------------------------


def _up(args: argparse.Namespace) -> int:
    import signal

    from attestation.sim_root import sim_root_dir
    from enclave.stop_signals import stop_on_signals, wait_until_stopped
    from veil.fleet import Fleet, FleetError, FleetSettings

    stopping = stop_on_signals((signal.SIGTERM,))  # Ctrl-C stays a KeyboardInterrupt, which stops the fleet too
    try:
        # The default simulated root, so that `veil chat` in another shell trusts this fleet as is.
        settings = FleetSettings(nodes=args.nodes, gateway_port=args.gateway_port, model_dir=args.model,
                                 workdir=args.workdir, sim_root_dir=sim_root_dir(), capacity=args.capacity,
                                 relay=args.relay, transparency=args.transparency)
        print(f"veil up: starting {args.nodes} node(s) and a gateway (SIMULATED attestation, development policy)",
              file=sys.stderr)
        with Fleet(settings) as fleet:
            print(fleet.client_url, flush=True)
            if fleet.relay is not None:
                print(f"veil up: the relay at {fleet.relay_url} forwards to the gateway at {fleet.gateway_url}",
                      file=sys.stderr)
            if fleet.log is not None:
                print(f"veil up: transparency log at {fleet.log_url}, witnesses at {', '.join(fleet.witness_urls)}; "
                      f"clients verify with --policy {fleet.policy}", file=sys.stderr)
            print(f"veil up: ready; logs and audit files in {fleet.workdir}. Ctrl-C stops the fleet.", file=sys.stderr)
            wait_until_stopped(stopping)
    except KeyboardInterrupt:
        pass
    except FleetError as error:
        print(f"veil up: {error}", file=sys.stderr)
        return 1
    print("veil up: stopped", file=sys.stderr)
    return 0


# ----- veil proxy --------------------------------------------------------------------------------


def _proxy(args: argparse.Namespace) -> int:
    from client.sdk import Client
    from serving.server import ServerStartError, bind_listener
    from policy import PolicyError

    try:
        client = Client(args.gateway, policy=args.policy, candidates=args.candidates,
                        fresh_evidence=args.fresh_evidence)
    except (PolicyError, ValueError) as error:
        print(f"veil proxy: {error}", file=sys.stderr)
        return 2
    with client:
        try:
            # Bound before anything is announced: a taken port is an error, never a banner then a failure.
            sock = bind_listener(args.listen)
        except ServerStartError as error:
            print(f"veil proxy: {error}", file=sys.stderr)
            return 2
        _warn_if_development(client.policy)
        host = args.listen.rpartition(":")[0]  # its form was checked with the other serving options (veil.cli)
        print(f"veil proxy: OpenAI-compatible API on http://{host}:{sock.getsockname()[1]}/v1, forwarding to "
              f"{args.gateway}", file=sys.stderr, flush=True)
        _serve_proxy(client, sock)
    return 0


def _serve_proxy(client: Any, sock: Any) -> None:
    import uvicorn

    from client.proxy import create_proxy_app

    config = uvicorn.Config(create_proxy_app(client), access_log=False, server_header=False, date_header=False,
                            log_level="warning")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


# ----- veil demo ---------------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from veil.demo import run_demo
    from veil.fleet import FleetError

    try:
        return run_demo(nodes=args.nodes, model_dir=args.model, tokens=args.tokens, relay=args.relay)
    except FleetError as error:
        print(f"veil demo: {error}", file=sys.stderr)
        return 1
