"""The real instruct families' tokenizers, templates and configs (tests/data/models), as Hugging Face folders.

The repository keeps each large `tokenizer.json` gzip-compressed, and Llama 3.1's once for both Llama folders
(Llama 3.2's text models share it byte for byte). `family_folder` assembles a family's folder, decompressed, in a
temporary directory once per test process and returns it; callers read it and never write to it.
"""

from __future__ import annotations

import atexit
import functools
import gzip
import shutil
import tempfile
from pathlib import Path

MODELS = Path(__file__).parent / "data" / "models"

# Families whose folder loads with `engine.Tokenizer` and `transformers.AutoTokenizer`.
FAMILIES = (
    "llama-3.1-8b-instruct",
    "llama-3.2-3b-instruct",
    "qwen2.5-3b-instruct",
    "qwen3-0.6b",
    "mistral-7b-instruct-v0.3",
)
# Template and configs only: DeepSeek-R1-Distill's own tokenizer.json was not in any reachable snapshot.
TEMPLATE_ONLY_FAMILIES = ("deepseek-r1-distill-qwen-32b",)

# A family whose tokenizer.json is another family's file, stored once.
_SHARED_TOKENIZER = {"llama-3.2-3b-instruct": "llama-3.1-8b-instruct"}
_COMPRESSED = "tokenizer.json.gz"


def family_folder(name: str) -> Path:
    """The family's ready folder (tokenizer.json, tokenizer_config.json, config.json …), built once per process."""
    if name not in FAMILIES + TEMPLATE_ONLY_FAMILIES:
        raise KeyError(f"no family {name!r} in {MODELS}; known: {', '.join(FAMILIES + TEMPLATE_ONLY_FAMILIES)}")
    folder = _cache_root() / name
    if not folder.is_dir():
        _assemble(name, folder)
    return folder


def _assemble(name: str, folder: Path) -> None:
    staging = folder.with_name(folder.name + ".partial")
    shutil.copytree(MODELS / name, staging, ignore=shutil.ignore_patterns(_COMPRESSED))
    compressed = MODELS / _SHARED_TOKENIZER.get(name, name) / _COMPRESSED
    if compressed.is_file():
        with gzip.open(compressed, "rb") as source, open(staging / "tokenizer.json", "wb") as target:
            shutil.copyfileobj(source, target)
    staging.rename(folder)  # whole or absent: a failed copy leaves no half folder behind


@functools.cache
def _cache_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="veil-families-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root
