"""`veil demo` (what `make demo` runs), as a real process on a fleet of one node: it serves the shipped trained
model, its greedy story is the one `transformers` writes from the same folder, and it still makes every check
it made on random weights (tokens, relay, transparency, receipts' route, the audit summary).

Also: the shipped model folder is complete and every file of it is package data, so an installed Veil
(editable or not) serves it without a checkout beside it.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch

from engine.tokenizer import Tokenizer
from tests.conftest import REPO_ROOT
from tests.engine_models import trained_model
from veil.demo import GREEDY_PROMPT, GREEDY_TOKENS
from veil.models import shipped_model_dir

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja", "LICENSE", "PROVENANCE.md")


def printed_story(stdout: str, label: str) -> str:
    """The story printed under `[label]`, its wrapped lines joined, whitespace made single spaces."""
    lines = stdout.split(f"[{label}]\n", 1)[1].splitlines()
    story = []
    for line in lines:
        if line.startswith("  served by node"):
            break
        story.append(line)
    return " ".join(" ".join(story).split())


def greedy_story() -> str:
    """transformers' greedy story from the demo's prompt, ended where the folder's generation config ends it."""
    reference = trained_model()
    tokenizer = Tokenizer(reference.folder)
    prompt = tokenizer.encode(GREEDY_PROMPT)
    with torch.no_grad():
        generated = reference.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                             dtype=torch.long), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                             eos_token_id=[2, 1], pad_token_id=0)
    tokens = generated[0].tolist()
    cut = len(tokens) == len(prompt) + GREEDY_TOKENS and tokens[-1] not in (1, 2)
    return " ".join(tokenizer.decode(tokens).split()) + ("…" if cut else "")


@pytest.mark.slow
def test_the_demo_tells_the_trained_models_greedy_story_and_makes_every_check() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "veil", "demo", "--nodes", "1"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "model served by the fleet: 'stories260K'" in out and "base model" in out and "noise" not in out
    story = printed_story(out, "completion, greedy")
    assert story == greedy_story()
    assert story.startswith("Once upon a time, there was a little girl named Lily.")
    for label in ("completion, sampled with seed 7", "chat"):
        assert len(printed_story(out, label).split()) > 10  # a story went on from the prompt
    for check in ("what the client verified itself", "transparency (checked offline",
                  "obtained blindly from the issuer", "a replayed token got 401",
                  "relay: every request went through the relay", "audit trail", "fleet stopped cleanly"):
        assert check in out
    served = re.search(r"requests: (\d+) \(ok (\d+)\)", out)
    assert served and served[1] == served[2] and int(served[1]) >= 4


def test_the_shipped_model_is_whole_and_package_data() -> None:
    folder = shipped_model_dir()
    assert sorted(path.name for path in folder.iterdir()) == sorted(MODEL_FILES)
    assert "MIT License" in (folder / "LICENSE").read_text()
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    package = folder.parent.relative_to(REPO_ROOT).as_posix().replace("/", ".")
    globs = pyproject["tool"]["setuptools"]["package-data"][package]
    for name in MODEL_FILES:
        assert any(fnmatch.fnmatch(f"{folder.name}/{name}", pattern) for pattern in globs), name
