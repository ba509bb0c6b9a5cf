"""Request-scoped n-gram drafting (prompt lookup): proposes the tokens that followed the latest earlier
occurrence of the sequence's own last n tokens.

Nothing is kept: each proposal is a pure function of one sequence's prompt and output at that step,
searched afresh, so no table of past tokens exists to outlive the request or to leak one request's
text into another's drafts (drafting from a database of past requests is what `policy` refuses).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import EngineError


@dataclass(frozen=True, slots=True)
class NgramDrafter:
    """Tries the longest pattern first: a longer match is likelier to predict what follows."""

    num_speculative_tokens: int
    max_ngram: int = 4
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise EngineError("n-gram drafting needs 1 <= min_ngram <= max_ngram")
        if self.num_speculative_tokens < 1:
            raise EngineError("num_speculative_tokens must be an integer >= 1")

    def propose(self, tokens: list[int], limit: int | None = None) -> list[int]:
        """Up to min(limit, num_speculative_tokens) tokens that followed the latest earlier match; [] if none."""
        count = self.num_speculative_tokens if limit is None else min(limit, self.num_speculative_tokens)
        if count < 1 or len(tokens) < self.min_ngram + 1:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            start = latest_match(ids, n)
            if start is not None:
                return list(tokens[start + n : start + n + count])
        return []


def latest_match(ids: np.ndarray, n: int) -> int | None:
    """Where the latest occurrence of ids' last n tokens starts, other than at the end itself; None if none."""
    # Windows that start before len - n, so the pattern never matches itself and a token always follows.
    windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
    hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
    return int(hits[-1]) if hits.size else None
