"""`veil model init-tiny` and `veil generate`, run as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine import SamplingParams
from engine.tiny import write_tiny_model
from engine.tokenizer import ChatMessage
from tests.conftest import REPO_ROOT
from tests.engine_models import greedy, one_torch_thread, tiny_dir, tiny_engine, tiny_model_dir  # noqa: F401 (fixtures)
from veil.cli import main

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
PROMPT = "Hello, world!"


def veil(*args: str) -> subprocess.CompletedProcess:
    # One intra-op thread: the tiny model gains nothing from more, and a busy machine loses a lot.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "veil", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env
    )


def test_init_tiny_writes_a_deterministic_model(tmp_path, tiny_dir):
    folder = tmp_path / "tiny"
    result = veil("model", "init-tiny", str(folder), "--seed", "0")
    assert result.returncode == 0, result.stderr
    assert str(folder) in result.stdout
    # Another process, same seed: the same bytes as the tests' own tiny model, file for file.
    for name in MODEL_FILES:
        assert (folder / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = write_tiny_model(tmp_path / "other", seed=1)
    assert (folder / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (folder / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_generate_streams_the_engines_greedy_text():
    result = veil("generate", "--model", str(tiny_model_dir()), PROMPT, "--max-tokens", "12", "--kv-cache-gib", "0.01")
    assert result.returncode == 0, result.stderr
    expected = tiny_engine(num_blocks=64).generate([PROMPT], greedy(12))[0].outputs[0].text
    assert expected.strip()
    assert result.stdout == expected + "\n"
    assert result.stderr == ""


# The remaining cases call the same entry point in this process (a new process per case only adds start-up time).


def test_generate_with_chat_template_and_sampling(capsys):
    args = ("--chat", "--max-tokens", "10", "--temperature", "0.8", "--seed", "4", "--kv-cache-gib", "0.01")
    assert main(["generate", "--model", str(tiny_model_dir()), PROMPT, *args]) == 0
    engine = tiny_engine(num_blocks=64)
    prompt = engine.tokenizer.encode_chat([ChatMessage("user", PROMPT)])
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=4)
    assert capsys.readouterr().out == engine.generate([prompt], params)[0].outputs[0].text + "\n"


def test_generate_error_is_one_line_without_the_prompt(tmp_path, capsys):
    canary = "CANARY-prompt-5150"
    assert main(["generate", "--model", str(tmp_path / "no-model"), canary, "--kv-cache-gib", "0.01"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("veil generate: ")
    assert captured.err.count("\n") == 1
    assert "config.json" in captured.err
    assert canary not in captured.err + captured.out


def test_generate_rejected_request_exits_cleanly(capsys):
    assert main(["generate", "--model", str(tiny_model_dir()), PROMPT, "--top-p", "0", "--kv-cache-gib", "0.01"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "veil generate: top_p must be a number in (0, 1]\n"
    assert PROMPT not in captured.err + captured.out


def test_model_files_are_a_real_hugging_face_folder():
    """transformers itself loads what init-tiny writes, and computes the engine's logits."""
    import torch
    from transformers import LlamaForCausalLM

    from tests.engine_models import hf_logits, prefill_logits

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir()).eval()
    engine = tiny_engine(num_blocks=64, block_size=4)
    prompt = engine.tokenizer.encode(PROMPT)
    torch.testing.assert_close(prefill_logits(engine, [prompt])[0], hf_logits(model, prompt), atol=5e-5, rtol=1e-5)
    assert Path(tiny_model_dir() / "generation_config.json").is_file()
