"""What the benchmark scripts share."""

from __future__ import annotations

import sys
import time


def progress(message: str) -> None:
    """What is running now, on stderr, so a long run shows it is alive without mixing into the results."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
