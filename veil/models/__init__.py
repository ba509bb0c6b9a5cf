"""The model Veil ships: what `veil up` and `veil demo` serve unless given another folder (`--model DIR`).

`stories260K/` is Andrej Karpathy's llama2.c stories260K, a 260K-parameter Llama trained on TinyStories,
as a Hugging Face folder (MIT: its LICENSE and PROVENANCE.md are beside it). A base model: it continues
text, so its prompts are story openings, and its chat template writes a chat as plain text (with tools
in the Hermes format). The folder is package data: it is found installed, editable or not, never in a
checkout's neighbours.
"""

from __future__ import annotations

from pathlib import Path

STORIES_260K = Path(__file__).resolve().parent / "stories260K"


def shipped_model_dir() -> Path:
    """The shipped model's folder (read-only in an installed package: nothing writes to it)."""
    return STORIES_260K
