"""Privacy Pass issuer keys in the transparency log: `veil issuer --transparency-log` logs each key it
publishes (current and next) once, before serving, and has the log cosigned; `veil log audit --policy`
lists them and flags a key id the policy accepts that the log never showed."""

from __future__ import annotations

from pathlib import Path

import pytest

from attestation.transparency.encoded_keys import parse_verifier
from attestation.transparency.statements import IssuerKeyStatement, decode_statement
from issuer.keys import add_key
from transparency.fetch import directory_fetch
from transparency.reader import LogReader
from tests.issuer_support import write_config
from tests.token_support import policy_listing
from tests.transparency_support import veil_server
from veil.cli import main

FUTURE = 4_000_000_000  # a next key, published beside the current one until then


def _log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["log", "init", str(tmp_path / "log"), "--origin", "log.example/veil", "--key",
                 str(tmp_path / "log.key")]) == 0
    return capsys.readouterr().out.strip()


def _issuer_statements(log: Path, log_key: str) -> list[IssuerKeyStatement]:
    reader = LogReader(directory_fetch(log), parse_verifier(log_key))
    return [decode_statement(reader.entry(index)) for index in range(reader.size)]  # type: ignore[misc]


def test_the_issuer_logs_the_keys_it_serves_once_and_an_audit_checks_a_policys_keys(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_key = _log(tmp_path, capsys)
    retired, current, upcoming = (add_key(tmp_path / "keys", not_before) for not_before in (1_000, 2_000, FUTURE))
    served_ids = [key.token_key.key_id.hex() for key in (current, upcoming)]
    assert main(["witness", "--key", str(tmp_path / "w.key"), "--new-key", "w.example"]) == 0
    witness_key = capsys.readouterr().out.strip()
    issuer = ("issuer", "--config", str(write_config(tmp_path, [])), "--keys", str(tmp_path / "keys"),
              "--transparency-log", str(tmp_path / "log"), "--transparency-log-key", str(tmp_path / "log.key"))
    with veil_server("witness", "--key", str(tmp_path / "w.key"), "--log", log_key, "--state",
                     str(tmp_path / "w.state"), port_file=tmp_path / "w.port") as witness:
        with veil_server(*issuer, "--transparency-witness", witness, port_file=tmp_path / "issuer.port"):
            pass
    statements = _issuer_statements(tmp_path / "log", log_key)
    assert [(s.token_key_id, s.not_before, s.not_after) for s in statements] == [
        (served_ids[0], 2_000, 2_000 + 90 * 86400), (served_ids[1], FUTURE, FUTURE + 90 * 86400)]
    note = LogReader(directory_fetch(tmp_path / "log"), parse_verifier(log_key)).signed.note
    assert parse_verifier(witness_key).timestamp(note) is not None  # cosigned once the keys were logged

    with veil_server(*issuer, port_file=tmp_path / "issuer.port"):  # a restart logs nothing twice
        pass
    assert len(_issuer_statements(tmp_path / "log", log_key)) == 2

    audit = ["log", "audit", str(tmp_path / "log"), "--log-key", log_key, "--state", str(tmp_path / "seen.json")]
    assert main([*audit, "--policy", str(policy_listing(tmp_path / "served.toml", [current, upcoming]))]) == 0
    out = capsys.readouterr().out
    assert all(f"issuer key {key_id} valid" in out for key_id in served_ids) and "FLAGGED" not in out
    # A policy that also accepts a key the issuer never published (one user's own key, say) is flagged.
    listing = policy_listing(tmp_path / "special.toml", [current, retired])
    assert main([*audit, "--policy", str(listing)]) == 1
    out = capsys.readouterr().out
    assert f"FLAGGED issuer key {retired.token_key.key_id.hex()}: the policy accepts it, the log never showed it" \
        in out
    assert out.count("FLAGGED") == 1


def test_the_issuer_does_not_serve_keys_it_cannot_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_key = _log(tmp_path, capsys)
    add_key(tmp_path / "keys", 2_000)
    assert main(["log", "init", str(tmp_path / "other"), "--origin", "log.example/veil", "--key",
                 str(tmp_path / "other.key")]) == 0
    capsys.readouterr()
    base = ["issuer", "--config", str(write_config(tmp_path, [])), "--keys", str(tmp_path / "keys"),
            "--transparency-log", str(tmp_path / "log")]
    for extra, expected in (([], "--transparency-log needs --transparency-log-key"),
                            (["--transparency-log-key", str(tmp_path / "other.key")],
                             "cannot log the token keys in"),
                            (["--transparency-log-key", str(tmp_path / "log.key"), "--transparency-lifetime-s", "0"],
                             "a positive --transparency-lifetime-s")):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert "veil issuer: cannot start:" in err and expected in err and "Traceback" not in err
    assert _issuer_statements(tmp_path / "log", log_key) == []


def test_an_audit_refuses_a_policy_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_key = _log(tmp_path, capsys)
    (tmp_path / "bad.toml").write_text("[authorization]\nissuer_keys = 7\n")
    status = main(["log", "audit", str(tmp_path / "log"), "--log-key", log_key, "--state", str(tmp_path / "s.json"),
                   "--policy", str(tmp_path / "bad.toml")])
    err = capsys.readouterr().err
    assert status == 2 and f"the policy {tmp_path / 'bad.toml'} cannot be used" in err
    assert not (tmp_path / "s.json").exists() and "Traceback" not in err
