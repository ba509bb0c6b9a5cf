"""The engine's exceptions.

Messages describe what was wrong in terms of sizes and limits only: they never
contain prompt text, output text or token ids.
"""


class EngineError(Exception):
    """Base class for every error the engine raises."""


class ModelLoadError(EngineError):
    """The model folder is missing, malformed or of an unsupported architecture."""


class RequestRejected(EngineError):
    """A request cannot be served as asked; only that request fails.

    `reason` is a stable machine-readable code (for audit and HTTP mapping).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):
        # Crosses the pipe from the engine core whole: reason and message, as raised.
        return type(self), (self.reason, str(self))


class UnknownRequestError(EngineError):
    """An operation named a request id the engine does not hold."""
