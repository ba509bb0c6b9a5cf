"""The `veil` command line: every default in --help, strict by default, plain words for an unreachable gateway."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator

import pytest

from veil.cli import build_parser, has_default, main


def _parsers(parser: argparse.ArgumentParser, path: str = "veil") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from _parsers(subparser, f"{path} {name}")


def _options() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    return [(path, parser, action) for path, parser in _parsers(build_parser()) for action in parser._actions
            if action.option_strings and action.help != argparse.SUPPRESS and action.nargs != 0]


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return " ".join(formatter._expand_help(action).split())


def test_every_subcommand_is_walked() -> None:
    paths = {path for path, _ in _parsers(build_parser())}
    assert {"veil chat", "veil proxy", "veil up", "veil demo", "veil node", "veil gateway",
            "veil attest collect", "veil audit report routes", "veil generate"} <= paths


@pytest.mark.parametrize("path,parser,action", _options(),
                         ids=lambda value: value if isinstance(value, str) else getattr(value, "dest", ""))
def test_every_option_of_every_subcommand_says_its_default(path: str, parser: argparse.ArgumentParser,
                                                           action: argparse.Action) -> None:
    text = _help_of(parser, action)
    if action.required:
        return  # nothing to default: argparse refuses the command without it
    assert "default" in text, f"{path} {action.option_strings[0]}: help does not say its default"
    if has_default(action) and "(default: %(default)s)" not in (action.help or ""):
        # A default the help words itself must still be the value the option takes.
        assert str(action.default) in text or _worded(action), (
            f"{path} {action.option_strings[0]}: help does not show the default {action.default!r}")


def _worded(action: argparse.Action) -> bool:
    """A default the help words rather than quotes (e.g. `(default: $VEIL_GATEWAY or ...)`)."""
    return action.dest in {"gateway"}


@pytest.mark.parametrize("option,shown", [("--candidates", "routing.candidates"), ("--listen", "127.0.0.1:8080")])
def test_proxy_help_shows_the_defaults_of_candidates_and_listen(option: str, shown: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["proxy", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert shown in help_text[help_text.index(option):]


def test_chat_and_proxy_verify_under_strict_unless_told_otherwise() -> None:
    parser = build_parser()
    assert parser.parse_args(["chat", "hello"]).policy == "strict"
    assert parser.parse_args(["proxy"]).policy == "strict"


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_chat_against_an_unreachable_gateway_says_it_could_not_be_reached(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["chat", "a private question", "--gateway", url, "--policy", "dev"]) == 1
    error = capsys.readouterr().err
    assert "could not be reached" in error and "answered 0" not in error
    assert "a private question" not in error


def test_the_demo_escapes_control_bytes_of_a_streamed_answer(capsys: pytest.CaptureFixture[str]) -> None:
    from client.types import ChatCompletionChunk
    from veil.demo import print_streamed

    pieces = ["plain ", "\x1b[2J\x1b]0;title\x07", "tab\there\r\n", "é\u2028"]
    chunks = [ChatCompletionChunk.from_dict({"choices": [{"index": 0, "delta": {"content": piece}}]})
              for piece in pieces]
    print_streamed(chunks)
    out = capsys.readouterr().out
    assert out == "plain \\x1b[2J\\x1b]0;title\\x07tab\\there\\r\\né\\u2028"
    assert not any(not char.isprintable() for char in out)
