"""What every layer of one forward derives alike from the step's inputs, computed once per forward.

A decoder calls the same kernels once per layer with the same step metadata (block tables, context
lengths, positions): the checks of that metadata, the CPU attention's gather plan and the rotary rows of
the step's positions are the same in every layer. Inside `one_forward()` the first layer's are kept and
the others reuse them; outside it each call computes its own. Keys hold the `id` of the step's tensors,
which stay alive (and unchanged) for the whole forward, so an id cannot be reused while the memo lives.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

_Value = TypeVar("_Value")
_memo: ContextVar[dict[Hashable, object] | None] = ContextVar("veil_kernels_per_forward", default=None)


@contextmanager
def one_forward() -> Iterator[None]:
    """Runs the block as one forward: layer-independent derivations are computed by the first layer only."""
    token = _memo.set({})
    try:
        yield
    finally:
        _memo.reset(token)


def once(key: Hashable, compute: Callable[[], _Value]) -> _Value:
    """`compute()`, or inside `one_forward()` the value it gave for `key` earlier in the same forward."""
    memo = _memo.get()
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]  # type: ignore[return-value]


def check_once(key: Hashable, check: Callable[..., None], *arguments: object) -> None:
    """`check(*arguments)`, but inside `one_forward()` only until it has passed once for `key`: `once` for a
    check, without a closure to build on every call (it runs on every kernel call of every layer)."""
    memo = _memo.get()
    if memo is None or key not in memo:
        check(*arguments)
        if memo is not None:
            memo[key] = None
