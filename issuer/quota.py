"""Per-account token quotas: how many tokens each account has had in the current period, and nothing more."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from issuer.errors import QuotaExceededError


@dataclass(slots=True)
class _Usage:
    period: int
    issued: int


class QuotaLedger:
    """Counts tokens per account in fixed periods (period number = floor(now / period_s)), in memory."""

    def __init__(self, tokens_per_period: int, period_s: float, clock: Callable[[], float] = time.time) -> None:
        self._limit = tokens_per_period
        self._period_s = period_s
        self._clock = clock
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()

    def take(self, account: str) -> None:
        """Count one token for `account`, or raise QuotaExceededError if its period's quota is used up."""
        period = int(self._clock() // self._period_s)
        with self._lock:
            usage = self._usage.get(account)
            if usage is None or usage.period != period:
                usage = self._usage[account] = _Usage(period, 0)
            if usage.issued >= self._limit:
                raise QuotaExceededError("this account has used its tokens for the current period; wait for the next")
            usage.issued += 1

    def give_back(self, account: str) -> None:
        """Uncount a token that was not issued after all (the request was refused after counting)."""
        with self._lock:
            usage = self._usage.get(account)
            if usage is not None and usage.issued > 0:
                usage.issued -= 1

    def issued(self, account: str) -> int:
        """Tokens counted for `account` in the current period."""
        period = int(self._clock() // self._period_s)
        usage = self._usage.get(account)
        return usage.issued if usage is not None and usage.period == period else 0

    def records(self) -> dict[str, tuple[int, int]]:
        """Everything the ledger holds: account -> (period number, tokens issued)."""
        with self._lock:
            return {account: (usage.period, usage.issued) for account, usage in self._usage.items()}
