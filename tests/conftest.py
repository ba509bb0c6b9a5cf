"""Shared test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# In CI every run draws the same examples, so a result is reproducible from the log alone; locally
# hypothesis keeps exploring new ones. Either way nothing is written to a local example database.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("local", database=None)
settings.load_profile("ci" if os.environ.get("CI") else "local")

REPO_ROOT = Path(__file__).resolve().parents[1]
# The bound on every wait in the suite for a server, a process or a thread: it stops a hang from holding
# the suite, it never measures a speed, so it is generous enough for a loaded machine (minutes).
HANG_S = 300.0
_SHARED_VECTORS = REPO_ROOT.parent / "shared" / "vectors"
_BUNDLED_VECTORS = REPO_ROOT / "tests" / "data" / "vectors"


def vectors_path() -> Path:
    """Published conformance vectors: ../shared/vectors when present, else the bundled copy."""
    return _SHARED_VECTORS if _SHARED_VECTORS.is_dir() else _BUNDLED_VECTORS


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    return vectors_path()
