"""What a node measures about itself: its code, its policy and its model weights.

- code: every ``.py`` module file of the given packages, walked in sorted
  order of their paths relative to the package's parent (``engine/llm.py``),
  each contributing its path and the SHA-256 of its bytes;
- policy: the digest of the policy's canonical encoding (so that reformatting
  the policy file does not change the measurement, and any change of meaning does);
- model: every regular file of the model folder (weights, config, tokenizer),
  in sorted order of relative paths, each contributing its path and SHA-256; a node that
  speculates with a draft model runs both, so its model digest covers both folders' digests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from attestation.errors import AttestationError

# Every package of the distribution: a node is started as `python -m veil node`, whose command line
# (`veil.cli`) assembles the subcommands of all of them, so the code digest names the release as a whole.
DEFAULT_PACKAGES: tuple[str, ...] = (
    "attestation", "audit", "client", "enclave", "engine", "gateway", "issuer", "kernels", "ohttp", "policy",
    "protocol", "relay", "serving", "transparency", "veil",
)
_MEASUREMENT_TAG = b"veil-measurement-v1"
_CODE_TAG = b"veil-code-v1"
_MODEL_TAG = b"veil-model-v1"
_MODEL_PAIR_TAG = b"veil-model-and-draft-v1"
NO_MODEL_DIGEST = hashlib.sha256(b"veil-no-model-v1").digest()
_CHUNK = 1 << 20


class MeasurementError(AttestationError):
    """The code, policy or model to measure cannot be read."""

    check = "measure"


@dataclass(frozen=True, slots=True)
class Measurement:
    """The three digests a node attests to (each 32 bytes, SHA-256)."""

    code_digest: bytes
    policy_digest: bytes
    model_digest: bytes

    def __post_init__(self) -> None:
        for name in ("code_digest", "policy_digest", "model_digest"):
            if len(getattr(self, name)) != 32:
                raise ValueError(f"{name} must be a 32-byte SHA-256 digest")

    def digest(self) -> bytes:
        """SHA-256 over the three digests: the value bound into the evidence."""
        return hashlib.sha256(_MEASUREMENT_TAG + self.code_digest + self.policy_digest + self.model_digest).digest()


def measure(
    code_packages: Sequence[str] = DEFAULT_PACKAGES,
    policy_path: str | Path | None = None,
    model_dir: str | Path | None = None,
    draft_dir: str | Path | None = None,
) -> Measurement:
    """Measure the installed code packages, the policy file at `policy_path` and the model in `model_dir`
    (with the draft model in `draft_dir`, when the node speculates with one)."""
    if policy_path is None:
        raise MeasurementError("measure() needs policy_path: the policy file the node runs under")
    return Measurement(
        code_digest=measure_code(code_packages),
        policy_digest=measure_policy(policy_path),
        model_digest=measure_model(model_dir) if draft_dir is None else measure_pair(model_dir, draft_dir),
    )


def measure_code(packages: Sequence[str]) -> bytes:
    """Digest of every module file of `packages` (found without importing them)."""
    hasher = hashlib.sha256(_CODE_TAG)
    for package in sorted(set(packages)):
        root = _package_dir(package)
        files = sorted(root.rglob("*.py"), key=lambda path: path.relative_to(root).as_posix())
        _hash_files(hasher, root.parent, (path for path in files if "__pycache__" not in path.parts))
    return hasher.digest()


def measure_policy(policy_path: str | Path) -> bytes:
    """The digest of the policy's canonical encoding."""
    from policy import PolicyError, load_policy

    try:
        return load_policy(policy_path).digest
    except PolicyError as error:
        raise MeasurementError(f"the policy to measure is invalid: {error}") from None


def measure_model(model_dir: str | Path | None) -> bytes:
    """Digest of every file in `model_dir`; a fixed digest when the node serves no model."""
    if model_dir is None:
        return NO_MODEL_DIGEST
    root = Path(model_dir)
    if not root.is_dir():
        raise MeasurementError(f"model folder {root} does not exist or is not a folder")
    files = sorted((path for path in root.rglob("*") if path.is_file()), key=lambda path: path.relative_to(root).as_posix())
    hasher = hashlib.sha256(_MODEL_TAG)
    _hash_files(hasher, root, files)
    return hasher.digest()


def measure_pair(model_dir: str | Path | None, draft_dir: str | Path) -> bytes:
    """The model digest of a node whose draft model proposes tokens to its model: both folders' digests
    in that order, so an allowlist names the pair and neither can be swapped unnoticed."""
    return hashlib.sha256(_MODEL_PAIR_TAG + measure_model(model_dir) + measure_model(draft_dir)).digest()


def _package_dir(package: str) -> Path:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MeasurementError(f"package {package!r} is not installed; it cannot be measured")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def _hash_files(hasher: "hashlib._Hash", base: Path, files: Iterable[Path]) -> None:
    for path in files:
        name = path.relative_to(base).as_posix().encode("utf-8")
        hasher.update(struct.pack(">I", len(name)) + name + _file_digest(path))


def _file_digest(path: Path) -> bytes:
    file_hasher = hashlib.sha256()
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                file_hasher.update(chunk)
    except OSError as error:
        raise MeasurementError(f"cannot read {path} to measure it: {error.strerror}") from None
    return file_hasher.digest()
