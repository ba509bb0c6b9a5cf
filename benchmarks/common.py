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


def kernels_line(device_type: str) -> str:
    """Which kernels a run on `device_type` used, and for a CPU whether a batch-1 decode and the paged attention
    ran compiled (`kernels.cpu_decode`) or eagerly and why: `VEIL_KERNELS=reference` runs the eager ones to compare."""
    import torch

    import kernels
    from kernels import cpu_decode

    backend = kernels.selected_backend(torch.device(device_type))
    if device_type != "cpu":
        return f"kernels: {backend}"
    if backend != "native":
        return f"kernels: {backend} (batch-1 decode and attention eager; VEIL_KERNELS unset compiles them where the CPU can)"
    built = cpu_decode.build()
    if built.library is None:
        return f"kernels: native, but batch-1 decode and attention eager: {built.reason}"
    return ("kernels: native (batch-1 decode and paged attention compiled, kernels/cpu_decode.c; "
            "VEIL_KERNELS=reference for the eager ones)")
