"""`veil policy show` and `veil policy check`."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `veil policy …` to the veil command line."""
    parser = subparsers.add_parser("policy", help="show or check a measured policy")
    commands = parser.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    show = commands.add_parser("show", help="print a policy's canonical form and digest")
    show.add_argument("policy", metavar="NAME|FILE", help="shipped policy name (strict, dev) or a file")
    show.set_defaults(handler=_show)
    check = commands.add_parser("check", help="validate a policy file")
    check.add_argument("policy", metavar="FILE", help="policy file to validate")
    check.set_defaults(handler=_check)


def _show(args: argparse.Namespace) -> int:
    from policy import PolicyError, resolve_policy
    from policy.canonical import canonical_encoding

    try:
        policy = resolve_policy(args.policy)
    except PolicyError as error:
        print(f"policy refused: {error}", file=sys.stderr)
        return 1
    print(json.dumps(json.loads(canonical_encoding(policy)), indent=2, sort_keys=True))
    print(f"digest: {policy.digest.hex()}")
    if policy.is_development:
        print("WARNING: development policy: it accepts SIMULATED evidence", file=sys.stderr)
    return 0


def _check(args: argparse.Namespace) -> int:
    from policy import ForbiddenOptimizationError, PolicyError, load_policy

    try:
        policy = load_policy(args.policy)
    except ForbiddenOptimizationError as error:
        print(f"✗ refused ({error.requirement}): {error}")
        return 1
    except PolicyError as error:
        print(f"✗ invalid: {error}")
        return 1
    print(f"✓ policy {policy.name!r} is valid; digest {policy.digest.hex()}")
    if policy.is_development:
        print("  note: development policy, accepts SIMULATED evidence")
    return 0
