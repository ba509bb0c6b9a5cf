"""Measurement of code, policy and model: deterministic, and sensitive to every change."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from attestation.measurement import (
    DEFAULT_PACKAGES,
    NO_MODEL_DIGEST,
    MeasurementError,
    measure,
    measure_code,
    measure_model,
    measure_policy,
)
from policy import shipped_policy, shipped_policy_path
from tests.conftest import REPO_ROOT
from tests.policy_support import filled_strict, filled_strict_text, write_filled_strict


@pytest.fixture()
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "code"
    folder = root / "veilmeasuretarget"
    (folder / "sub").mkdir(parents=True)
    (folder / "__init__.py").write_text("VALUE = 1\n")
    (folder / "sub" / "module.py").write_text("def f():\n    return 2\n")
    monkeypatch.syspath_prepend(str(root))
    return folder


def test_code_digest_is_deterministic_and_order_free(package):
    first = measure_code(["veilmeasuretarget"])
    assert measure_code(["veilmeasuretarget"]) == first
    assert measure_code(["veilmeasuretarget", "veilmeasuretarget"]) == first


def test_code_digest_changes_with_any_module_edit(package):
    before = measure_code(["veilmeasuretarget"])
    (package / "sub" / "module.py").write_text("def f():\n    return 3\n")
    assert measure_code(["veilmeasuretarget"]) != before


def test_code_digest_changes_when_a_module_is_added_or_renamed(package):
    before = measure_code(["veilmeasuretarget"])
    (package / "extra.py").write_text("")
    added = measure_code(["veilmeasuretarget"])
    assert added != before
    (package / "extra.py").rename(package / "other.py")
    assert measure_code(["veilmeasuretarget"]) not in (before, added)


def test_bytecode_caches_are_not_measured(package):
    before = measure_code(["veilmeasuretarget"])
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "x.py").write_text("junk")
    (package / "notes.txt").write_text("not a module")
    assert measure_code(["veilmeasuretarget"]) == before


def test_a_missing_package_cannot_be_measured():
    with pytest.raises(MeasurementError, match="not installed"):
        measure_code(["veil_no_such_package"])


def test_the_real_packages_are_measured_without_importing_them():
    import sys

    sys.modules.pop("gateway", None)
    digest = measure_code(("gateway", "policy"))
    assert len(digest) == 32
    assert "gateway" not in sys.modules



def test_every_package_of_the_distribution_is_measured():
    """The code digest covers what is installed: every package pyproject.toml ships, none left out."""
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    shipped = {pattern.removesuffix("*") for pattern in setuptools["packages"]["find"]["include"]}
    assert shipped == set(DEFAULT_PACKAGES)


# What a node process has loaded once `python -m veil node` has built its command line and its node module.
_NODE_START = """
import json, sys
from veil.cli import build_parser
import enclave.node
build_parser()
print(json.dumps({name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}))
"""


def test_every_module_a_node_starts_with_is_in_a_measured_package():
    loaded = json.loads(subprocess.run([sys.executable, "-c", _NODE_START], cwd=REPO_ROOT, capture_output=True,
                                       text=True, check=True, timeout=300).stdout)
    # Modules of this checkout's own packages (a virtual environment inside it holds no package of ours).
    ours = {name.split(".")[0] for name, file in loaded.items()
            if file and Path(file).resolve().is_relative_to(REPO_ROOT / name.split(".")[0])}
    assert {"veil", "enclave", "engine", "protocol"} <= ours
    assert ours <= set(DEFAULT_PACKAGES), f"a node runs unmeasured code from {sorted(ours - set(DEFAULT_PACKAGES))}"

def test_policy_digest_is_the_canonical_one(tmp_path: Path):
    reformatted = tmp_path / "strict.toml"
    reformatted.write_text(filled_strict_text().replace(" = ", "=") + "\n# note\n")
    assert measure_policy(reformatted) == filled_strict().digest
    assert measure_policy(shipped_policy_path("dev")) != filled_strict().digest


def test_an_invalid_policy_cannot_be_measured(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text(filled_strict_text().replace('kv_offload = "none"', 'kv_offload = "disk"'))
    with pytest.raises(MeasurementError, match="invalid"):
        measure_policy(bad)


def test_model_digest_covers_every_file(tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(bytes(1000))
    before = measure_model(model)
    assert before != NO_MODEL_DIGEST
    (model / "model.safetensors").write_bytes(bytes(999) + b"\x01")
    after_weights = measure_model(model)
    assert after_weights != before
    (model / "tokenizer.json").write_text("{}")
    assert measure_model(model) != after_weights


def test_model_digest_depends_on_file_names(tmp_path: Path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    (one / "a.bin").write_bytes(b"x")
    (two / "b.bin").write_bytes(b"x")
    assert measure_model(one) != measure_model(two)


def test_missing_model_folder_is_an_error(tmp_path: Path):
    with pytest.raises(MeasurementError):
        measure_model(tmp_path / "absent")


def test_measure_combines_the_three(tmp_path: Path):
    measurement = measure(("policy",), shipped_policy_path("dev"), None)
    assert measurement.policy_digest == shipped_policy("dev").digest
    assert measurement.model_digest == NO_MODEL_DIGEST
    other = measure(("policy",), policy_path=write_filled_strict(tmp_path / "strict.toml"))
    assert other.digest() != measurement.digest()
    with pytest.raises(MeasurementError):
        measure(("policy",))
