"""`veil audit report transparency`: the monitor's log audit written beside the non-targetability report,
through the real command: what it lists, its red lines, a tampered or rolled-back log, and bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from attestation.transparency.statements import (
    IssuerKeyStatement,
    NodeKeyStatement,
    ReleaseStatement,
    encode_statement,
)
from attestation.transparency.tiles import encode_bundle, parse_bundle
from issuer.keys import add_key
from transparency.keys import read_signer
from transparency.log import append_entries
from tests.test_audit_routes import route_events, simulate_routes, write_audit_file
from tests.token_support import policy_listing
from veil.cli import main


def _digest(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


TRUSTED = ReleaseStatement("1.0.0", _digest("code"), _digest("policy"), (_digest("model"),))
SPECIAL = ReleaseStatement("1.0.1-special", _digest("special code"), _digest("policy"), (_digest("model"),))
NODE_KEY = NodeKeyStatement(_digest("key config"), _digest("measurement"), 1_000, 2_000, "ab" * 32)


@pytest.fixture
def log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, str]:
    """A log of a trusted release, a node key and an issuer key, made with the operator's commands."""
    assert main(["log", "init", str(tmp_path / "log"), "--origin", "log.example/veil", "--key",
                 str(tmp_path / "log.key")]) == 0
    log_key = capsys.readouterr().out.strip()
    issuer = add_key(tmp_path / "issuer-keys", 1_000)
    statements = [json.loads(encode_statement(statement)) for statement in
                  (TRUSTED, NODE_KEY, IssuerKeyStatement(issuer.token_key.key_id.hex(), 1_000, 9_000))]
    (tmp_path / "statements.json").write_text(json.dumps(statements))
    assert main(["log", "append", str(tmp_path / "log"), "--key", str(tmp_path / "log.key"), "--statement",
                 str(tmp_path / "statements.json")]) == 0
    policy_listing(tmp_path / "policy.toml", [issuer])
    (tmp_path / "trusted").write_text(f"{TRUSTED.code_digest}\n")
    capsys.readouterr()
    return tmp_path / "log", log_key


def _report(log: Path, log_key: str, out: Path, *extra: str) -> int:
    return main(["audit", "report", "transparency", str(log), "--log-key", log_key, "--state",
                 str(log.parent / "auditor.json"), "--out", str(out), *extra])


def test_the_report_sits_beside_the_routes_report_and_lists_the_log(
        log: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory, log_key = log
    out = tmp_path / "reports"
    write_audit_file(tmp_path / "gateway.jsonl", route_events(*simulate_routes(seed=1, decisions=2_000)))
    assert main(["audit", "report", "routes", str(tmp_path / "gateway.jsonl"), "--out", str(out)]) == 0
    listed = ("--trusted", str(tmp_path / "trusted"), "--policy", str(tmp_path / "policy.toml"))
    assert _report(directory, log_key, out, *listed) == 0
    printed = capsys.readouterr().out
    assert "routes report: " in printed and f"transparency report: {out / 'transparency.md'}" in printed
    assert printed.rstrip().endswith("(consistent)")
    markdown = (out / "transparency.md").read_text()
    assert (out / "routes.md").is_file() and (out / "transparency.html").is_file()
    assert "**✓ The log log.example/veil is consistent" in markdown and "3 entries" in markdown
    assert "first audit of this log by this auditor" in markdown
    assert f"| 0 | 1.0.0 | {TRUSTED.code_digest} | {TRUSTED.policy_digest} | 1 | trusted |" in markdown
    assert f"| 1 | {NODE_KEY.key_config_digest} | {NODE_KEY.measurement} | 1000 | 2000 |" in markdown
    assert "## Issuer keys (1)" in markdown and "RED LINE" not in markdown

    append_entries(directory, read_signer(tmp_path / "log.key"), [encode_statement(TRUSTED)])
    assert _report(directory, log_key, out, *listed) == 0
    assert "consistent with the tree of size 3 this auditor saw last" in (out / "transparency.md").read_text()


def test_untrusted_releases_and_unlogged_policy_keys_are_red_lines(
        log: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory, log_key = log
    append_entries(directory, read_signer(tmp_path / "log.key"), [encode_statement(SPECIAL)])
    unlogged = add_key(tmp_path / "issuer-keys", 5_000)  # a key the issuer could hand one user
    policy = policy_listing(tmp_path / "special.toml", [unlogged])
    assert _report(directory, log_key, tmp_path / "out", "--trusted", str(tmp_path / "trusted"),
                   "--policy", str(policy)) == 1
    assert "(RED LINE)" in capsys.readouterr().out
    markdown = (tmp_path / "out" / "transparency.md").read_text()
    assert "entry 3: release 1.0.1-special runs code the auditor does not trust" in markdown
    assert (f"issuer key {unlogged.token_key.key_id.hex()}: the policy accepts it, the log never showed it"
            in markdown)
    assert "| ✗ RED LINE: **3** | **1.0.1-special** |" in markdown and "✓" not in markdown


def test_a_tampered_or_rolled_back_log_is_a_red_line_and_leaves_the_state(
        log: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory, log_key = log
    snapshot = shutil.copytree(directory, tmp_path / "snapshot")
    append_entries(directory, read_signer(tmp_path / "log.key"), [encode_statement(SPECIAL)])
    assert _report(directory, log_key, tmp_path / "out") == 0
    state = (tmp_path / "auditor.json").read_bytes()
    bundle = directory / "tile/entries/000.p/4"
    entries = parse_bundle(bundle.read_bytes(), 4)
    bundle.write_bytes(encode_bundle([*entries[:3], entries[0]]))  # hide the special release
    for log_now, expected in ((directory, "entry bundle tile/entries/000.p/4 is not what the signed tree holds: "
                                          "an entry duplicated at position 3"),
                              (snapshot, "the log is smaller (3) than when last audited (4)")):
        assert _report(log_now, log_key, tmp_path / "out") == 1
        markdown = (tmp_path / "out" / "transparency.md").read_text()
        assert f"failed its audit: {expected}" in markdown and "state file was left as it was" in markdown
        assert (tmp_path / "auditor.json").read_bytes() == state
    capsys.readouterr()


def test_unusable_input_exits_2_without_a_report(log: tuple[Path, str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    directory, log_key = log
    for extra, expected in ((("--log-key", "o+00000000+AAAA"), "the auditor's keys or trusted list cannot be used"),
                            (("--witness-key", log_key), "is not a witness key"),
                            (("--policy", str(tmp_path / "absent.toml")), "cannot be used")):
        arguments = ["audit", "report", "transparency", str(directory), "--log-key", log_key, "--state",
                     str(tmp_path / "auditor.json"), "--out", str(tmp_path / "out"), *extra]
        assert main(arguments) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "auditor.json").exists()
