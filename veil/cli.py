"""The `veil` command line, and what `python -m veil` runs: the one place every process of a fleet starts.

Each package owns its own subcommands in a `cli.py` module exposing
`register(subparsers)`, and `veil.commands` those that use the SDK and the
local fleet; this module only assembles them, so the SDK (`client`) never
imports the command line, the engine, the node or the gateway.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

# Modules that contribute subcommands, in the order `veil --help` lists them.
# A module that is missing (a package not built yet) is simply left out.
COMMAND_MODULES: tuple[str, ...] = (
    "veil.commands",
    "engine.cli",
    "attestation.cli",
    "policy.cli",
    "enclave.cli",
    "gateway.cli",
    "relay.cli",
    "issuer.cli",
    "transparency.cli",
    "audit.cli",
    "transparency.audit_cli",  # adds `veil audit report transparency`, so after audit.cli
)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Says every option's default in its help, unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or not has_default(action):
            return text
        return f"{text} (default: %(default)s)"


def has_default(action: argparse.Action) -> bool:
    """Whether the option has a value when not given (a flag off, an absent option or an empty list has none)."""
    default = action.default
    return not (default is None or default is False or default == [] or default == argparse.SUPPRESS)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Gives `parser` and every subcommand parser under it the DefaultsHelpFormatter, and its full name
    (`veil log serve`) for messages about its options."""
    parser.formatter_class = DefaultsHelpFormatter
    parser.set_defaults(command_name=parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _show_defaults(subparser)


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
    # Subcommands are registered by their own packages; every one shows its defaults the same way.
    _show_defaults(parser)
    return parser


def server_option_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the options the serving commands share (--listen, --port-file), or None.

    Checked here, before a command starts anything: gRPC would read a port past 65535 modulo 65536 and
    serve where nobody asked, and a port file that cannot be written would fail a server already up.
    """
    listen = getattr(args, "listen", None)
    if isinstance(listen, str):
        host, _, port = listen.rpartition(":")
        if not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
            return "--listen must look like HOST:PORT with a port from 0 to 65535 (for example 127.0.0.1:8000)"
    port_file = getattr(args, "port_file", None)
    if port_file is not None:
        folder = Path(port_file).parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            return f"--port-file: {folder} is not a folder this user can write in"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from veil.config_file import ConfigFileError, apply_config_file

    parser = build_parser()
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        apply_config_file(parser, arguments)  # the file's options become defaults; flags still override them
    except ConfigFileError as error:
        print(f"veil {arguments[0]}: {error}", file=sys.stderr)
        return 2
    args = parser.parse_args(arguments)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    problem = server_option_problem(args)
    if problem is not None:
        print(f"{args.command_name}: {problem}", file=sys.stderr)
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
