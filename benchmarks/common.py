"""What the benchmark scripts share."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass


def progress(message: str) -> None:
    """What is running now, on stderr, so a long run shows it is alive without mixing into the results."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts (token ids) and how many tokens to generate for each."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)
