"""The policies that ship with Veil: `strict` for production, `dev` for development only."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from policy.errors import UnknownPolicyError
from policy.loader import load_policy
from policy.model import Policy

ShippedName = Literal["strict", "dev"]
SHIPPED_NAMES: tuple[str, ...] = ("strict", "dev")
_HERE = Path(__file__).resolve().parent


def shipped_policy_path(name: ShippedName) -> Path:
    """Path of a shipped policy file."""
    if name not in SHIPPED_NAMES:
        raise UnknownPolicyError(f"no shipped policy named {name!r}; choose one of {list(SHIPPED_NAMES)}")
    return _HERE / f"{name}.toml"


def shipped_policy(name: ShippedName) -> Policy:
    """Load a shipped policy."""
    return load_policy(shipped_policy_path(name))


def resolve_policy(name_or_path: str | Path) -> Policy:
    """A shipped policy by name, or a policy file by path (for command lines)."""
    if str(name_or_path) in SHIPPED_NAMES:
        return shipped_policy(str(name_or_path))  # type: ignore[arg-type]
    return load_policy(name_or_path)


def resolve_policy_path(name_or_path: str | Path) -> Path:
    """The file behind a shipped policy name or a path."""
    if str(name_or_path) in SHIPPED_NAMES:
        return shipped_policy_path(str(name_or_path))  # type: ignore[arg-type]
    return Path(name_or_path)
