"""The `veil` command line.

Each package owns its own subcommands in a `cli.py` module exposing
`register(subparsers)`; this module only assembles them, so the SDK itself
never imports the engine, the node or the gateway.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that contribute subcommands, in the order `veil --help` lists them.
# A module that is missing (a package not built yet) is simply left out.
COMMAND_MODULES: tuple[str, ...] = (
    "client.commands",
    "engine.cli",
    "attestation.cli",
    "policy.cli",
    "enclave.cli",
    "gateway.cli",
    "audit.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="veil",
        description="Veil: private LLM inference on attested confidential-computing GPU nodes.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`veil ... | head`): stop quietly, as other command-line tools do.
        sys.stderr.close()
        return 141


if __name__ == "__main__":
    sys.exit(main())
