"""Stopping a long-running command on SIGTERM or SIGINT, whichever thread the kernel hands the signal to.

Python runs a signal's handler in the main thread, the next time that thread runs Python code. The
kernel may deliver a process's signal to any of its threads (gRPC's, the engine's reader, the
stapler's): the handler then only marks itself pending, and a main thread asleep in an untimed wait
never runs it, so a SIGTERM could leave a node serving, undrained, for good. The main thread therefore
waits in short slices, and runs any pending handler between them.
"""

from __future__ import annotations

import signal
import threading

POLL_S = 0.2  # how late a pending handler may run at most, once its signal has arrived


def stop_on_signals(signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> threading.Event:
    """An event that any of `signals` sets (call from the main thread, before starting what it stops)."""
    stopped = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stopped.set()

    for stop_signal in signals:
        signal.signal(stop_signal, handler)
    return stopped


def wait_until_stopped(stopped: threading.Event) -> None:
    """Blocks until `stopped` is set, running pending signal handlers at least every POLL_S."""
    while not stopped.wait(POLL_S):
        pass
