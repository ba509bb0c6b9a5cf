"""Command-line options from a TOML file (`--config FILE`): every serving command's options, flags overriding.

A key is an option's long flag without its dashes (`listen`, `drain-s`; `drain_s` too); its value has
the option's type (a string, a number, a boolean for a switch, a list or one value for a repeatable
option such as `node`). The file's values become the command's defaults, so a flag on the command
line wins (a repeatable flag adds to the file's list).
`veil node`, `veil gateway` and `veil relay` read the whole file; `veil issuer`, whose `--config` is
its issuer configuration, reads its options from that file's `[serve]` table. An unknown key, a
value of the wrong type or a file that does not parse is an error naming the key, never its value.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Set by a subcommand that takes its options from --config: "" for the whole file, else the table's name.
CONFIG_TABLE = "config_table"


class ConfigFileError(Exception):
    """The options file cannot be used; the message names the file and the key."""


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Make the options in the file `argv` names with --config the defaults of its subcommand."""
    if not argv:
        return
    subparser = _subparsers(parser).get(argv[0])
    if subparser is None or subparser.get_default(CONFIG_TABLE) is None:
        return
    path = _config_path(argv[1:])
    if path is None:
        return
    options = _read_table(path, subparser.get_default(CONFIG_TABLE))
    actions = {option.lstrip("-"): action for action in subparser._actions for option in action.option_strings
               if option.startswith("--")}
    defaults = {}
    for key, value in options.items():
        action = actions.get(key.replace("_", "-"))
        if action is None or action.dest in ("config", "help"):
            raise ConfigFileError(f"{path}: {key!r} is not an option of veil {argv[0]} (keys are its long options "
                                  "without the dashes; see --help)")
        defaults[action.dest] = _converted(path, key, action, value)
        action.required = False  # given by the file; a flag still overrides it
    subparser.set_defaults(**defaults)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _config_path(arguments: Sequence[str]) -> Path | None:
    for index, argument in enumerate(arguments):
        if argument == "--config" and index + 1 < len(arguments):
            return Path(arguments[index + 1])
        if argument.startswith("--config="):
            return Path(argument.removeprefix("--config="))
    return None


def _read_table(path: Path, table: str) -> dict[str, Any]:
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        if table:
            return {}  # the command's own configuration file: the command itself says what is wrong with it
        if isinstance(error, OSError):
            raise ConfigFileError(f"cannot read the options file {path} ({error.strerror})") from None
        raise ConfigFileError(f"the options file {path} is not valid TOML ({type(error).__name__})") from None
    if not table:
        return document
    options = document.get(table, {})
    if not isinstance(options, dict):
        raise ConfigFileError(f"{path}: [{table}] must be a table of options")
    return options


def _converted(path: Path, key: str, action: argparse.Action, value: Any) -> Any:
    """`value` as the option would hold it, or ConfigFileError naming the key and the expected type."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{path}: {key!r} is a switch; give true or false")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse._AppendAction):  # repeatable: a list, or one value
        return [_one(path, key, action, item) for item in (value if isinstance(value, list) else [value])]
    return _one(path, key, action, value)


def _one(path: Path, key: str, action: argparse.Action, value: Any) -> Any:
    kind = action.type or str
    if isinstance(value, (dict, list)) or isinstance(value, bool):
        raise ConfigFileError(f"{path}: {key!r} takes one value, not a table, list or boolean")
    if kind in (int, float) and not isinstance(value, int | float):
        raise ConfigFileError(f"{path}: {key!r} must be a number")
    if kind is int and not isinstance(value, int):
        raise ConfigFileError(f"{path}: {key!r} must be a whole number")
    if kind not in (int, float) and not isinstance(value, str):
        raise ConfigFileError(f"{path}: {key!r} must be a string")
    try:
        converted = kind(value)
    except (TypeError, ValueError):
        raise ConfigFileError(f"{path}: {key!r} does not have the option's form (see --help)") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigFileError(f"{path}: {key!r} must be one of {', '.join(map(str, action.choices))}")
    return converted
