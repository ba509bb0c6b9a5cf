"""What `veil chat` and `veil demo` print about a route: what was verified of each candidate, and which node served.

Only identifiers and check outcomes, never content.
"""

from __future__ import annotations

from typing import Any


def describe_route(route: Any, compact: bool = False) -> str:
    """What was verified about each candidate, and which node served (no content, only identifiers).

    `compact` lists every check of the serving node only, one line for each other candidate.
    """
    lines = [f"verified under policy {route.policy_name!r}; served by node {(route.node_id or '?')[:16]}"]
    for record in route.candidates:
        mark = "served" if record.node_id == route.node_id else "candidate"
        if record.verified is None:
            lines.append(f"  node {record.node_id[:16]} ({mark}): REFUSED at {record.failed_check}: {record.failure}")
            continue
        node = record.verified
        kind = "SIMULATED " if node.simulated else ""
        lines.append(f"  node {record.node_id[:16]} ({mark}): {kind}{node.backend} evidence, capacity {record.capacity}"
                     + (f", all {len(node.checks)} checks passed" if compact and mark == "candidate" else ""))
        if compact and mark == "candidate":
            continue
        lines.append(f"    receipt key {node.receipt_key.hex()} (bound into the evidence; signs its answers)")
        lines += [f"    {'ok ' if c.passed else '-- '} {c.name}: {c.detail}" for c in node.checks]
    return "\n".join(lines)
