"""Errors of the log's store, its fetcher and the witness protocol (part of the transparency hierarchy)."""

from __future__ import annotations

from attestation.transparency.errors import TransparencyError


class LogStoreError(TransparencyError):
    """The log's directory or key cannot be read or written, or is not a log's."""


class LogGrewError(LogStoreError):
    """Cosignatures came back for a checkpoint that an append has since replaced: ask the witnesses again."""


class LogFetchError(TransparencyError):
    """A log could not be fetched (connection, status, oversized answer)."""


class WitnessRequestError(TransparencyError):
    """An add-checkpoint request is malformed, or a witness answered with something other than a cosignature."""


class WitnessConfigError(TransparencyError):
    """A witness's configuration is inconsistent (two keys for one log)."""


class UnknownLogError(TransparencyError):
    """A witness was asked to cosign a checkpoint of a log it does not follow."""


class StaleSizeError(TransparencyError):
    """The log believed the witness at another size than the witness is; `size` is the witness's."""

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size
