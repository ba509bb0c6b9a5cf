"""The kernels package's exception hierarchy.

Messages name shapes, dtypes, devices and counts only: never tensor contents, which may be a user's data.
"""

from __future__ import annotations


class KernelError(Exception):
    """Base class for every error raised by `kernels`."""


class KernelInputError(KernelError, ValueError):
    """A kernel was called with tensors of the wrong shape, dtype or device, or with out-of-range indices.

    Raised before anything is launched or written, by both the Triton and the reference path.
    """


class KernelBackendError(KernelError, RuntimeError):
    """The requested kernel backend cannot run here (unknown name, or Triton on a CPU without the interpreter)."""
