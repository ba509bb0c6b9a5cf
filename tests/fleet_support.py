"""A real local fleet for tests whose own clients must trust its simulated attestation root while it runs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from attestation.sim_root import ROOT_DIR_ENV
from veil.fleet import Fleet, FleetSettings


@contextmanager
def running_fleet(settings: FleetSettings) -> Iterator[Fleet]:
    """Start the fleet, point this process's verifier at its simulation root, and put the old root back after."""
    previous = os.environ.get(ROOT_DIR_ENV)
    with Fleet(settings) as running:
        os.environ[ROOT_DIR_ENV] = str(running.sim_root_dir)
        try:
            yield running
        finally:
            if previous is None:
                os.environ.pop(ROOT_DIR_ENV, None)
            else:
                os.environ[ROOT_DIR_ENV] = previous
