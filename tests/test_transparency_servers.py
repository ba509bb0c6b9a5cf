"""`veil log serve` and two `veil witness` processes on loopback: the log appends, both witnesses cosign
over HTTP, a monitor audits the served log, and the witnesses refuse a fork and a rollback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from attestation.transparency.checkpoint import Checkpoint, open_checkpoint
from attestation.transparency.encoded_keys import parse_verifier
from attestation.transparency.note import sign_note
from transparency.keys import read_signer
from transparency.protocol import AddCheckpoint, encode_add_checkpoint
from veil.cli import main
from tests.conftest import HANG_S

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
CODE = "c0" * 32


def _spawn(*args: str, port_file: Path) -> tuple[subprocess.Popen, Path]:
    return subprocess.Popen([sys.executable, "-m", "veil", *args, "--listen", "127.0.0.1:0", "--port-file",
                             str(port_file)], cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True), port_file


def _started(spawned: tuple[subprocess.Popen, Path]) -> tuple[subprocess.Popen, str]:
    process, port_file = spawned
    deadline = time.monotonic() + HANG_S
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the server did not start: " + process.communicate()[1])
        time.sleep(0.05)
    return process, f"http://127.0.0.1:{int(port_file.read_text())}"


def _stop(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=HANG_S)
    assert process.returncode == 0, stderr
    return stderr


def _statements(path: Path, code: str, version: str) -> Path:
    path.write_text(json.dumps([
        {"type": "veil.release/v1", "version": version, "code_digest": code, "policy_digest": "ab" * 32,
         "model_digests": ["cd" * 32], "launch_measurements": [{"tee": "sev-snp", "measurement": "ef" * 48}]},
        {"type": "veil.node-key/v1", "key_config_digest": "12" * 32, "measurement": "34" * 32,
         "not_before": 1000, "not_after": 2000, "receipt_key": "56" * 32},
    ]))
    return path


def test_a_log_two_witnesses_and_an_audit_over_http(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "init", str(tmp_path / "log"), "--origin", "log.example/veil", "--key",
                 str(tmp_path / "log.key")]) == 0
    log_key = capsys.readouterr().out.strip()
    witness_keys = []
    for name in ("w1", "w2"):
        assert main(["witness", "--key", str(tmp_path / f"{name}.key"), "--new-key", f"{name}.example"]) == 0
        witness_keys.append(capsys.readouterr().out.strip())
    spawned = [_spawn("witness", "--key", str(tmp_path / f"{name}.key"), "--log", log_key, "--state",
                      str(tmp_path / f"{name}.state"), port_file=tmp_path / f"{name}.port") for name in ("w1", "w2")]
    spawned.append(_spawn("log", "serve", str(tmp_path / "log"), port_file=tmp_path / "log.port"))
    *servers, (served, log_url) = [_started(each) for each in spawned]  # the three start side by side
    try:
        for version, code in (("1.0", CODE), ("1.1-special", "5e" * 32)):
            statements = _statements(tmp_path / f"{version}.json", code, version)
            assert main(["log", "append", str(tmp_path / "log"), "--key", str(tmp_path / "log.key"), "--statement",
                         str(statements), *(arg for _, url in servers for arg in ("--witness", url))]) == 0
        assert "cosigned by w1.example, w2.example" in capsys.readouterr().err
        note = (tmp_path / "log" / "checkpoint").read_bytes()
        signed = open_checkpoint(note, parse_verifier(log_key))
        assert signed.checkpoint.size == 4
        for key in witness_keys:  # each cosignature verifies under its witness key, over the size-4 tree
            assert parse_verifier(key).timestamp(signed.note) is not None

        (tmp_path / "trusted").write_text(f"{CODE}  # release 1.0\n")
        status = main(["log", "audit", log_url, "--log-key", log_key, "--state", str(tmp_path / "audit.json"),
                       "--trusted", str(tmp_path / "trusted"), "--witness-key", witness_keys[0]])
        out = capsys.readouterr().out
        assert status == 1  # the special release is flagged
        assert "4 entries" in out and "cosigned by: w1.example\n" in out
        assert "not verified, no key given): w2.example" in out
        assert f"trusted 1.0 code {CODE}" in out and "FLAGGED untrusted release 1.1-special" in out
        assert "node key " + "12" * 32 in out and "receipt key " + "56" * 32 in out

        # A fork (another tree of size 4, signed by the log's own key) and a rollback: both witnesses refuse.
        signer = read_signer(tmp_path / "log.key")
        fork = sign_note(Checkpoint("log.example/veil", 4, b"\x07" * 32).body(), signer).encode()
        rollback = sign_note(Checkpoint("log.example/veil", 2, b"\x07" * 32).body(), signer).encode()
        for _, url in servers:
            # c2sp.org/tlog-witness: another root at the witness's size 422; `old` above the checkpoint's size 400.
            for forged, status, reason in ((fork, 422, "two trees"), (rollback, 400, "above the checkpoint's size")):
                answer = httpx.post(f"{url}/add-checkpoint", content=encode_add_checkpoint(AddCheckpoint(4, (), forged)))
                assert answer.status_code == status and reason in answer.text
        # The log server serves the log's files and nothing else.
        assert httpx.get(f"{log_url}/checkpoint").content == note
        assert httpx.get(f"{log_url}/tile/0/000.p/4").status_code == 200
        for path in ("/.lock", "/tile/0/../../log.key", "/tile/0/000.p/9", "/tile/entries/0001"):
            assert httpx.get(f"{log_url}{path}").status_code == 404
        for url in (log_url, *(url for _, url in servers)):  # no API documentation, as no Veil server has
            assert all(httpx.get(f"{url}{path}").status_code == 404 for path in ("/docs", "/openapi.json"))
    finally:
        stderrs = [_stop(process) for process, _ in [*servers, (served, log_url)]]
    assert all("serving on 127.0.0.1:" in stderr and "POST" not in stderr and "GET" not in stderr
               for stderr in stderrs)  # no access log


def test_the_commands_say_what_is_wrong_and_exit_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s.json").write_text("{}")
    assert main(["log", "init", str(tmp_path / "log"), "--origin", "o", "--key", str(tmp_path / "k")]) == 0
    assert main(["log", "init", str(tmp_path / "log"), "--origin", "o", "--key", str(tmp_path / "k2")]) == 2
    (tmp_path / "a-file").write_text("")  # a log directory that cannot be created: no key is left behind
    assert main(["log", "init", str(tmp_path / "a-file" / "log"), "--origin", "o", "--key", str(tmp_path / "k3")]) == 2
    assert not (tmp_path / "k3").exists()
    assert main(["log", "append", str(tmp_path / "empty"), "--key", str(tmp_path / "k"), "--statement",
                 str(_statements(tmp_path / "ok.json", CODE, "1"))]) == 1
    assert main(["log", "append", str(tmp_path / "log"), "--key", str(tmp_path / "k"), "--statement",
                 str(tmp_path / "s.json")]) == 1
    assert main(["log", "audit", str(tmp_path / "nowhere"), "--log-key", "o+00000000+AAAA", "--state",
                 str(tmp_path / "st")]) == 2  # the auditor's own key is unusable: the log is not looked at
    assert main(["witness", "--key", str(tmp_path / "k")]) == 2
    err = capsys.readouterr().err
    for expected in ("already holds a log", "cannot create", "holds no log; run `veil log init` first", "statement 0",
                     "is not a witness key"):
        assert expected in err
    assert "Traceback" not in err
