"""Plot helpers on matplotlib's Agg canvas (no display, no pyplot global state)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


def new_figure(width_in: float = 9.0, height_in: float = 4.5) -> Any:
    """A matplotlib Figure drawn by the Agg backend, independent of any GUI."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_png(figure: Any, path: Path) -> Path:
    """Write `figure` as a PNG file and return its path."""
    figure.savefig(path, format="png")
    return path


def short_ids(node_ids: Iterable[str], minimum: int = 8) -> dict[str, str]:
    """The shortest prefixes (at least `minimum` characters) that still tell `node_ids` apart."""
    unique = sorted(set(node_ids))
    length = minimum
    while len({node_id[:length] for node_id in unique}) < len(unique):
        length += 1
    return {node_id: node_id[:length] for node_id in unique}
