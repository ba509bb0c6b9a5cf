"""Per-request sampling settings, validated before a request is admitted."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import RequestRejected

# What a request that names no max_tokens gets, in the engine and through the node's API alike.
DEFAULT_MAX_TOKENS = 128
MAX_SAMPLES = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 8
MAX_STOP_STRING_LENGTH = 256
# Below this the scaled logits can overflow fp32 (at about 1e-37 they do); the distribution has
# collapsed onto its most likely token long before, so such temperatures are greedy.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens.

    `temperature` is in [0, 100]; any value below `MIN_TEMPERATURE` (1e-5), 0 included, means greedy:
    the most likely token every time, with no random draw.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report per token; None = off

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def validate(self, vocab_size: int) -> None:
        """Raises RequestRejected naming the first setting of the wrong type or out of range."""
        # Each check is a thunk so a type check guards the range check after it.
        checks = (
            (lambda: is_integer(self.max_tokens) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (lambda: _is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
             "temperature must be a number between 0 and 100"),
            (lambda: is_integer(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (lambda: _is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be a number in (0, 1]"),
            (lambda: _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be a number in [0, 1]"),
            (lambda: is_integer(self.n) and 1 <= self.n <= MAX_SAMPLES, f"n must be an integer between 1 and {MAX_SAMPLES}"),
            (lambda: self.seed is None or (is_integer(self.seed) and 0 <= self.seed < 2**63), "seed must be an integer in [0, 2^63)"),
            (lambda: isinstance(self.stop, (tuple, list)) and all(isinstance(s, str) for s in self.stop),
             "stop must be a list of strings"),
            (lambda: len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings"),
            (lambda: all(0 < len(s) <= MAX_STOP_STRING_LENGTH for s in self.stop), "stop strings must be 1-256 characters"),
            (lambda: isinstance(self.stop_token_ids, (tuple, list))
             and all(is_integer(t) and 0 <= t < vocab_size for t in self.stop_token_ids),
             "stop_token_ids must be valid token ids"),
            (lambda: self.logprobs is None or (is_integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be an integer between 0 and {MAX_LOGPROBS}"),
        )
        for ok, message in checks:
            if not ok():
                raise RequestRejected("invalid_sampling", message)


def is_integer(value: object) -> bool:
    """A true `int`: not a bool (an int subclass), not a float or string that could pass for one."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
