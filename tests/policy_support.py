"""`strict` as its operator fills it in, for every test that runs under it.

The shipped `policy/strict.toml` refuses to load until its transparency log's key and its witnesses' keys are
filled in (policy/placeholders.py). Tests use this one filled copy: the shipped file with those keys alone set,
each derived from a fixed seed, so that everything else a test reads is strict's own and the digest is the
same in every run. No log here signs anything: under this policy a node still needs proofs from a log the
test builds and names itself (tests/transparency_support.py).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from attestation.transparency.cosignature import CosignatureSigner
from attestation.transparency.note import NoteSigner
from policy import Policy, parse_policy
from policy.shipped import shipped_policy_path

FILLED_LOG = NoteSigner("log.test.example/veil", bytes([1]) * 32)
# The names strict ships its witness placeholders under, each given a key of its own.
FILLED_WITNESSES = tuple(CosignatureSigner(f"witness-{number}", bytes([1 + number]) * 32) for number in (1, 2, 3))


def strict_text() -> str:
    """The shipped strict.toml, as it is on disk (it refuses to load: its placeholders are empty)."""
    return shipped_policy_path("strict").read_text(encoding="utf-8")


def filled_strict_text(text: str | None = None) -> str:
    """`text` (default: the shipped strict.toml) with its log key and witness keys filled in, nothing else."""
    text = strict_text() if text is None else text
    fills = {'log_key = ""': f'log_key = "{FILLED_LOG.verifier.encode()}"'}
    for witness in FILLED_WITNESSES:
        fills[f'{{ name = "{witness.name}", key = "" }}'] = (
            f'{{ name = "{witness.name}", key = "{witness.verifier.encode()}" }}')
    for placeholder, filled in fills.items():
        assert text.count(placeholder) == 1, f"strict.toml no longer has the placeholder {placeholder}"
        text = text.replace(placeholder, filled)
    return text


@cache
def filled_strict() -> Policy:
    """The shipped strict policy with its placeholders filled in (policy/strict.toml's own values otherwise)."""
    return parse_policy(filled_strict_text())


def write_filled_strict(path: Path) -> Path:
    """Write the filled strict policy to `path`, for what takes a policy file (`--policy FILE`, a node)."""
    path.write_text(filled_strict_text(), encoding="utf-8")
    return path
