"""Async scheduling: the host prepares and launches step N+1 while the device still runs step N.

A synchronous step ends by reading its sampled ids back to the host, and the device then idles while
the host schedules the next step, builds its inputs, detokenizes and streams. With async scheduling
the engine launches step N+1 first and reads step N's ids afterwards, so that host work runs while the
device computes (on CUDA kernels and copies are queued, not waited for; on a CPU every op runs at once
and the two orders compute the same thing, which is how the tests compare them).

Step N+1 needs the tokens step N is still picking. Each sample waiting for one holds a *pending* token:
the host knows its position (so its KV slot, block and context length) but not its id. The step's
input list carries a placeholder that names the row of step N's picked-ids tensor, and the device
fills the real ids in before the forward (`fill_placeholders`): the ids never travel through the host.

What a finished sample costs: a sample that stops at step N (a stop token or stop string) was already
scheduled into step N+1; that step's token for it is discarded when step N+1 is read, and no delta
goes out for it, even to a newer request that took the ended one's id in between. A sample that
reaches max_tokens is never scheduled past it. Zero on free is unchanged: a block freed while a
launched step still writes it is zeroed by a kernel queued after that step on the same stream, and
only then handed to anyone else.
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.errors import EngineError


def async_scheduling_enabled(config: EngineConfig, device: torch.device) -> bool:
    """Whether steps overlap: by default on CUDA, where they run asynchronously, and not elsewhere."""
    if config.async_scheduling is None:
        return device.type == "cuda"
    return config.async_scheduling


def placeholder(row: int) -> int:
    """The input id that stands for row `row` of the in-flight step's picked ids (always negative)."""
    return -1 - row


def fill_placeholders(input_ids: torch.Tensor, picked: torch.Tensor | None) -> None:
    """Replaces, in place and on the device, every placeholder in input_ids by the id it names in picked.

    No host read: which entries are placeholders is decided on the device too.
    """
    if picked is None:
        raise EngineError("a step carries a pending token but no step is in flight to supply it; nothing ran")
    rows = (-1 - input_ids).clamp_(min=0, max=picked.numel() - 1)
    input_ids.copy_(torch.where(input_ids < 0, picked.index_select(0, rows), input_ids))
