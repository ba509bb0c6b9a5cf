"""`veil policy show` and `veil policy check` through the real veil command line."""

from __future__ import annotations

from pathlib import Path

from policy import shipped_policy_path
from tests.policy_support import filled_strict, filled_strict_text, write_filled_strict
from veil.cli import main


def test_show_prints_canonical_form_and_digest(capsys, tmp_path: Path):
    assert main(["policy", "show", str(write_filled_strict(tmp_path / "strict.toml"))]) == 0
    out = capsys.readouterr().out
    assert f"digest: {filled_strict().digest.hex()}" in out
    assert '"prefix_sharing": "request"' in out


def test_show_warns_about_development_policy(capsys):
    assert main(["policy", "show", str(shipped_policy_path("dev"))]) == 0
    assert "SIMULATED" in capsys.readouterr().err


def test_check_accepts_a_valid_file(capsys, tmp_path: Path):
    assert main(["policy", "check", str(write_filled_strict(tmp_path / "strict.toml"))]) == 0
    assert "✓" in capsys.readouterr().out


def test_check_names_the_requirement_of_a_refusal(tmp_path: Path, capsys):
    path = tmp_path / "cached.toml"
    path.write_text(filled_strict_text().replace(
        'prefix_sharing = "request"', 'prefix_sharing = "global"'))
    assert main(["policy", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "✗" in out and "stateless computation" in out
