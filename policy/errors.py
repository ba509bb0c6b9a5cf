"""The policy package's errors: every refusal says which rule it enforces."""

from __future__ import annotations


class PolicyError(Exception):
    """A policy file is unreadable, malformed or asks for something Veil refuses."""


class PolicySyntaxError(PolicyError):
    """The file is not valid TOML or not valid UTF-8."""


class UnknownKeyError(PolicyError):
    """A key the policy schema does not define (refused, never ignored)."""


class MissingKeyError(PolicyError):
    """A key the policy schema requires is absent."""


class InvalidValueError(PolicyError):
    """A value has the wrong type or lies outside its allowed range."""


class PlaceholderError(InvalidValueError):
    """A trust anchor the policy ships empty for its operator to fill (a transparency key) is still empty.

    `paths` names each empty one as a TOML path (`transparency.witnesses[1].key`); no key is ever held.
    """

    def __init__(self, message: str, *, paths: tuple[str, ...]) -> None:
        super().__init__(message)
        self.paths = paths


class ForbiddenOptimizationError(PolicyError):
    """The policy enables an optimization that breaks a Veil requirement.

    `requirement` names the requirement it would break, for example
    "stateless computation" or "non-targetability".
    """

    def __init__(self, message: str, *, requirement: str) -> None:
        super().__init__(message)
        self.requirement = requirement


class WeakenedGuaranteeError(ForbiddenOptimizationError):
    """The policy switches off a protection every Veil node must keep (CC mode, debug off)."""


class UnknownPolicyError(PolicyError):
    """A shipped policy name that does not exist."""
