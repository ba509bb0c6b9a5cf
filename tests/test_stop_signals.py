"""`enclave.stop_signals`: a stop signal the kernel hands to a thread other than the main one still ends
the main thread's wait (a node's SIGTERM once left it serving, undrained, past a 300 s deadline)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# The helper thread sends the signal to itself, after the main thread has had time to fall asleep in its
# wait: Python's C handler then runs on the helper and only marks the Python handler pending.
SCRIPT = """
import signal, threading, time
from enclave.stop_signals import stop_on_signals, wait_until_stopped

stopped = stop_on_signals((signal.SIGUSR1,))

def signal_this_thread():
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)

threading.Thread(target=signal_this_thread).start()
wait_until_stopped(stopped)
print("stopped", flush=True)
"""


def test_a_signal_delivered_to_another_thread_ends_the_wait() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"
