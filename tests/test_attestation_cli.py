"""`veil attest collect | veil attest verify` end to end, through the real command line."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attestation.bundle import EvidenceBundle
from attestation.verifier import CHECK_NAMES
from tests.policy_support import write_filled_strict
from tests.test_attestation_support import edit_json, sim_root_dir  # noqa: F401  (fixture)
from veil.cli import main

REPO = Path(__file__).resolve().parents[1]


def _collect(capsys, *arguments: str) -> str:
    assert main(["attest", "collect", "--attestation", "sim", *arguments]) == 0
    captured = capsys.readouterr()
    assert "SIMULATED" in captured.err
    return captured.out


def _verify(capsys, monkeypatch, text: str, policy: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code = main(["attest", "verify", "-", "--policy", policy])
    return code, capsys.readouterr().out


def test_collect_then_verify_under_dev_prints_every_check(capsys, monkeypatch):
    code, out = _verify(capsys, monkeypatch, _collect(capsys), "dev")
    assert code == 0
    for name in CHECK_NAMES:
        assert f"✓ {name}:" in out
    assert "VERIFIED node" in out


def test_the_same_bundle_under_strict_fails_at_the_simulated_check(capsys, monkeypatch, tmp_path: Path):
    code, out = _verify(capsys, monkeypatch, _collect(capsys), str(write_filled_strict(tmp_path / "strict.toml")))
    assert code == 1
    assert "✗ simulated:" in out and "REFUSED" in out
    assert all(f"· {name}: not run" in out for name in CHECK_NAMES[1:])


def test_verify_answers_the_given_nonce(capsys, monkeypatch, tmp_path: Path):
    bundle_text = _collect(capsys, "--nonce", "ab" * 32)
    path = tmp_path / "bundle.json"
    path.write_text(bundle_text)
    assert main(["attest", "verify", str(path), "--policy", "dev", "--nonce", "ab" * 32]) == 0
    capsys.readouterr()
    assert main(["attest", "verify", str(path), "--policy", "dev", "--nonce", "cd" * 32]) == 1
    assert "✗ freshness:" in capsys.readouterr().out


def test_collect_measures_the_given_model(capsys, tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with_model = EvidenceBundle.from_json(_collect(capsys, "--model", str(model)))
    without = EvidenceBundle.from_json(_collect(capsys))
    assert with_model.measurement.model_digest != without.measurement.model_digest


def test_a_malformed_bundle_fails_at_format(capsys, monkeypatch):
    text = edit_json(EvidenceBundle.from_json(_collect(capsys)), lambda d: d.update(version="v0"))
    code, out = _verify(capsys, monkeypatch, text, "dev")
    assert code == 1 and "✗ format:" in out


def test_collect_with_nvml_on_this_machine_explains_itself(capsys, tmp_path: Path):
    strict = str(write_filled_strict(tmp_path / "strict.toml"))  # what it defaults to, filled in
    code = main(["attest", "collect", "--attestation", "nvml", "--policy", strict])
    err = capsys.readouterr().err
    assert code == 1
    assert "NVML is missing" in err or "confidential computing is not in production mode" in err


def test_bad_arguments_are_reported(capsys):
    assert main(["attest", "collect", "--attestation", "sim", "--nonce", "zz"]) == 1
    assert "hexadecimal" in capsys.readouterr().err
    assert main(["attest", "verify", "/nonexistent/bundle.json", "--policy", "dev"]) == 2


def test_probe_reports_each_backend(capsys):
    assert main(["attest", "probe"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nvml:") and "tsm:" in out and "sim:" in out


def test_the_shell_pipeline(sim_root_dir: Path):
    environment = {**os.environ, "VEIL_SIM_ROOT_DIR": str(sim_root_dir)}
    veil = f"{sys.executable} -m veil"
    result = subprocess.run(
        f"{veil} attest collect --attestation sim | {veil} attest verify - --policy dev",
        shell=True, cwd=REPO, env=environment, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("✓") == len(CHECK_NAMES) + 1  # every check plus the format line
    assert "SIMULATED" in result.stderr


def test_measure_gives_the_digests_an_operator_pins_and_evidence_then_verifies_against_them(
        capsys, monkeypatch, tmp_path: Path):
    import json

    from attestation.measurement import measure
    from engine.tiny import write_tiny_model
    from policy.shipped import shipped_policy_path

    model = write_tiny_model(tmp_path / "model")
    assert main(["attest", "measure", "--model", str(model), "--policy", "dev", "--json"]) == 0
    digests = json.loads(capsys.readouterr().out)
    expected = measure(policy_path=shipped_policy_path("dev"), model_dir=model)
    assert digests == {"code_digest": expected.code_digest.hex(), "policy_digest": expected.policy_digest.hex(),
                       "model_digest": expected.model_digest.hex(), "measurement": expected.digest().hex()}
    assert main(["attest", "measure", "--model", str(model), "--policy", "dev"]) == 0
    assert f'allowed_model_digests = ["{digests["model_digest"]}"]' in capsys.readouterr().out

    # The operator's policy: only this code and this model, nothing unlisted.
    pinned = (shipped_policy_path("dev").read_text()
              .replace('name = "dev"', 'name = "lab"')
              .replace("allowed_code_digests = []", f'allowed_code_digests = ["{digests["code_digest"]}"]')
              .replace("accept_unlisted_code = true", "accept_unlisted_code = false")
              .replace("allowed_model_digests = []", f'allowed_model_digests = ["{digests["model_digest"]}"]')
              .replace("accept_unlisted_models = true", "accept_unlisted_models = false"))
    policy_file = tmp_path / "lab.toml"
    policy_file.write_text(pinned)
    code, out = _verify(capsys, monkeypatch, _collect(capsys, "--model", str(model), "--policy", str(policy_file)),
                        str(policy_file))
    assert code == 0 and "✓ measurement:" in out
    other = write_tiny_model(tmp_path / "other", seed=1)
    code, out = _verify(capsys, monkeypatch, _collect(capsys, "--model", str(other), "--policy", str(policy_file)),
                        str(policy_file))
    assert code == 1 and "✗ measurement:" in out


def test_measure_explains_a_missing_model_folder(capsys, tmp_path: Path):
    strict = write_filled_strict(tmp_path / "strict.toml")
    assert main(["attest", "measure", "--model", str(tmp_path / "absent"), "--policy", str(strict)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_collect_names_its_backend_option_as_the_node_does(capsys):
    """`veil attest collect --attestation` and `veil node --attestation`; `--backend` still works."""
    from veil.cli import build_parser

    parser = build_parser()
    for command in (["attest", "collect"], ["node", "--model", "m"]):
        assert parser.parse_args([*command, "--attestation", "sim"]).attestation == "sim"
    assert parser.parse_args(["attest", "collect", "--backend", "tsm"]).attestation == "tsm"
    with pytest.raises(SystemExit):
        main(["attest", "collect", "--help"])
    assert "--backend" not in capsys.readouterr().out
