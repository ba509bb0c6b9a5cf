"""Shared test fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
_SHARED_VECTORS = REPO_ROOT.parent / "shared" / "vectors"
_BUNDLED_VECTORS = REPO_ROOT / "tests" / "data" / "vectors"


def vectors_path() -> Path:
    """Published conformance vectors: ../shared/vectors when present, else the bundled copy."""
    return _SHARED_VECTORS if _SHARED_VECTORS.is_dir() else _BUNDLED_VECTORS


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    return vectors_path()
