"""Process logs with a time and a level: text lines, or JSON lines (`--log-format json`) for log collectors.

What a Veil process logs is its own operation (started, serving on an address, a node admitted or
evicted, draining), written by its own code with fixed sentences: never a prompt, a completion, a
token id, a key or a client's address. The JSON formatter writes the time (UTC, milliseconds), the
level, the logger's name and the message, and of an exception only its type: a traceback's text
could quote what a peer sent.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TextIO

LOG_FORMATS = ("text", "json")
# The loggers a Veil process writes through: its own, and uvicorn's errors (its access log is off).
_LEVELS = {"veil": logging.INFO, "uvicorn.error": logging.WARNING}


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


class JsonLinesFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message (and an exception's type, never its text)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": _timestamp(record.created), "level": record.levelname.lower(), "logger": record.name,
                "message": record.getMessage()}
        if record.exc_info and record.exc_info[0] is not None:
            line["error"] = record.exc_info[0].__name__
        return json.dumps(line, ensure_ascii=True)


class TextFormatter(logging.Formatter):
    """`TIME LEVEL message`, for a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{_timestamp(record.created)} {record.levelname} {record.getMessage()}"
        if record.exc_info and record.exc_info[0] is not None:
            text += f" ({record.exc_info[0].__name__})"
        return text


class _VeilHandler(logging.StreamHandler):
    """The one handler `configure_logging` installs (told apart from anyone else's).

    It writes to whatever `sys.stderr` is when a record is emitted, not the stream of the moment it
    was installed: a process that swaps its stderr (a test's capture, a daemon redirecting it) would
    otherwise log into a closed stream, and logging's own error report is a traceback of the caller.
    """

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass  # StreamHandler.__init__ and setStream assign it; the live sys.stderr always wins


def configure_logging(log_format: str = "text") -> None:
    """Send Veil's logs to stderr in `log_format`, replacing a format set before (idempotent)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"the log format must be one of {', '.join(LOG_FORMATS)}")
    handler = _VeilHandler(sys.stderr)
    handler.setFormatter(JsonLinesFormatter() if log_format == "json" else TextFormatter())
    for name, level in _LEVELS.items():
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _VeilHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


def ensure_logging() -> None:
    """Configure text logs unless a format was configured already."""
    if not any(isinstance(h, _VeilHandler) for h in logging.getLogger("veil").handlers):
        configure_logging("text")


def add_operation_options(parser: argparse.ArgumentParser) -> None:
    """--config FILE (this command's options from a TOML file, flags overriding; read by `veil.config_file`)
    and --log-format, which `veil node`, `veil gateway` and `veil relay` take."""
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="read this command's options from a TOML file (keys are the long options without "
                             "dashes); options on the command line override it (default: none)")
    parser.set_defaults(config_table="")  # the whole file holds options
    add_log_format(parser)


def add_log_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text lines, or JSON lines with time and level for a log collector (default: text)")
