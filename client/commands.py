"""Client-side subcommands of `veil`."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="run the local demonstration")
    demo.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    from engine.cli import run_engine_demo

    return run_engine_demo()
