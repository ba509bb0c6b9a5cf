"""The transparency servers as tests run them: `veil log serve` and `veil witness` as real processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def veil_server(*args: str, port_file: Path) -> Iterator[str]:
    """Run `veil <args> --listen 127.0.0.1:0`; yield its base URL once it serves, stop it cleanly after."""
    port_file.unlink(missing_ok=True)
    process = subprocess.Popen([sys.executable, "-m", "veil", *args, "--listen", "127.0.0.1:0", "--port-file",
                                str(port_file)], cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise AssertionError("the server did not start: " + process.communicate()[1])
            time.sleep(0.05)
        yield f"http://127.0.0.1:{int(port_file.read_text())}"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
