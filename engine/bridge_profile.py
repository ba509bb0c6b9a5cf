"""The crossings of a run as the CUDA profiler sees them: every copy the device made between host and device.

The bridge counts the copies it makes (`engine.bridge`), and a scan of the source checks that nothing
else in the engine or its kernels copies (tests/test_engine_crossings.py). Neither sees a copy made
inside a library call: an implicit `.item()`, a device tensor built from a Python scalar, a copy to or
from pageable memory that the driver stages again. The device does: CUPTI records every copy it runs,
and the profiler names each "Memcpy <kind> (<source> -> <destination>)", e.g. "Memcpy HtoD (Pinned ->
Device)". Over a window of engine steps the host-to-device and device-to-host copies it saw must equal
the bridge's own count, one each way per decode step, and none may touch pageable memory (on a
confidential-computing GPU a pageable copy crosses the bounce buffer after a second staging copy).

Needs CUDA: the count comes from the device, so on a CPU there is nothing to count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from engine.errors import EngineError

_MEMCPY = "Memcpy "
_CROSSING_KINDS = {"HtoD": "h2d", "DtoH": "d2h"}  # DtoD, and memsets, stay on the device


@dataclass(frozen=True, slots=True)
class ProfiledCopies:
    """The copies between host and device that the device ran in a profiled window."""

    h2d: int
    d2h: int
    pageable: int  # of those, copies from or to pageable host memory (each staged again by the driver)
    kinds: tuple[tuple[str, int], ...]  # every copy name seen, device-side ones too, with its count

    def describe(self) -> str:
        """The copies by name, for a report: 'Memcpy HtoD (Pinned -> Device) x20, ...'."""
        return ", ".join(f"{name} x{count}" for name, count in self.kinds) or "no copies"


def tally(event_names: Iterable[str]) -> ProfiledCopies:
    """The crossings among a profile's event names: copies whose kind is HtoD or DtoH."""
    copies = Counter(name for name in event_names if name.startswith(_MEMCPY))
    crossed = {"h2d": 0, "d2h": 0}
    pageable = 0
    for name, count in copies.items():
        direction = _CROSSING_KINDS.get(name[len(_MEMCPY):].split(" ", 1)[0])
        if direction is None:
            continue
        crossed[direction] += count
        if "Pageable" in name:
            pageable += count
    return ProfiledCopies(crossed["h2d"], crossed["d2h"], pageable, tuple(sorted(copies.items())))


def profile_copies(run: Callable[[], object]) -> ProfiledCopies:
    """Runs `run` under the CUDA profiler and counts the crossings the device made meanwhile.

    The device is synchronized before the window opens (copies queued earlier are not counted) and
    before it closes (every copy `run` queued has run and is counted), whichever thread queued it.
    """
    if not torch.cuda.is_available():
        raise EngineError("counting copies under the CUDA profiler needs a CUDA device, and none is available")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        run()
        torch.cuda.synchronize()
    return tally(event.name for event in profiler.events())
