"""Every wait in the suite bounds a hang, never a speed: on a loaded machine a short bound fails a test that
would have passed. A wait for a server, a process or a thread takes the shared `HANG_S` (minutes)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import HANG_S

TESTS = Path(__file__).resolve().parent
NUMBER = r"(\d+(?:\.\d+)?)"
# A literal bound on a wait: a deadline, a join, an event's or a process's wait, a future's result, a
# subprocess's output, a wait_for, or the default bound of a helper that waits.
WAIT_BOUNDS = [re.compile(pattern + NUMBER + r"\b") for pattern in (
    r"deadline = time\.monotonic\(\) \+ ", r"\.join\((?:timeout=)?", r"\.result\((?:timeout=)?",
    r"\.wait\((?:timeout=)?", r"communicate\(timeout=", r"wait_for\(.*timeout=",
    r"(?:timeout|timeout_s|bound_s): float = ",
)]
# Under this a wait checks that something does NOT happen in a moment; it is not a bound on a hang.
MOMENT_S = 5.0


def short_wait_bounds(text: str) -> list[str]:
    """The lines of `text` that bound a wait by a literal shorter than HANG_S (a graceful stop's wait before a
    kill is no bound: passing it only kills the process)."""
    lines = text.splitlines()
    found = []
    for number, line in enumerate(lines):
        graceful = any("except subprocess.TimeoutExpired" in later for later in lines[number + 1:number + 3])
        for pattern in WAIT_BOUNDS:
            for match in pattern.finditer(line):
                if MOMENT_S <= float(match.group(1)) < HANG_S and not graceful:
                    found.append(f"{number + 1}: {line.strip()}")
    return found


def test_the_shared_bound_is_minutes() -> None:
    assert HANG_S >= 120


def test_no_wait_in_the_suite_is_bounded_shorter_than_the_shared_bound() -> None:
    offenders = {path.name: found for path in sorted(TESTS.glob("*.py"))
                 if path.name != Path(__file__).name and (found := short_wait_bounds(path.read_text()))}
    assert offenders == {}, f"use tests.conftest.HANG_S for these waits: {offenders}"


def test_the_check_sees_a_short_bound_and_passes_a_moment_and_a_graceful_stop() -> None:
    assert short_wait_bounds("gateway.wait_for(lambda: done, timeout=10)\n") != []
    assert short_wait_bounds("    deadline = time.monotonic() + 30\n") != []
    assert short_wait_bounds("assert not released.wait(0.2)\n") == []
    assert short_wait_bounds("try:\n    process.wait(5)\nexcept subprocess.TimeoutExpired:\n    process.kill()\n") == []
