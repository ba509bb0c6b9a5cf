"""How a tile or entry bundle differs from what the rest of the log implies, in words a monitor reports.

The monitor knows the hashes a tile must hold (recomputed from the entries, or from the level below);
naming the kind of change (changed, removed, inserted, reordered, duplicated) and its position lets
an auditor tell an edit from a reshuffle without the report ever quoting an entry.
"""

from __future__ import annotations

from collections.abc import Sequence


def describe_difference(expected: Sequence[bytes], got: Sequence[bytes], item: str, items: str) -> str:
    """One phrase for how `got` differs from `expected` (hashes of `items`, one `item` each), or "" if equal."""
    if list(got) == list(expected):
        return ""
    if len(got) != len(expected):
        change = "removed" if len(got) < len(expected) else "added"
        return f"holds {len(got)} {items} where the tree has {len(expected)} ({items} {change})"
    article = "an" if item[0] in "aeiou" else "a"
    first = next(index for index, (old, new) in enumerate(zip(expected, got, strict=True)) if old != new)
    if sorted(got) == sorted(expected):
        return f"{items} reordered from position {first}"
    shifted = first < len(got) - 1  # a change at the last position is just that
    if shifted and list(got[first:-1]) == list(expected[first + 1:]):
        return f"the {item} at position {first} removed (the later ones moved up)"
    if shifted and list(got[first + 1:]) == list(expected[first:-1]):
        return f"{article} {item} inserted at position {first} (the later ones moved down)"
    if set(got) <= set(expected):
        return f"{article} {item} duplicated at position {first} in place of the tree's"
    return f"the {item} at position {first} changed"
