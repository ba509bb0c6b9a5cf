"""`veil issuer` as a real process: adding a key, readiness, issuing, clean shutdown, refusal to start."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ohttp.privacypass import TOKEN_REQUEST_MEDIA_TYPE, TokenChallenge, begin_issuance, decode_directory, finish_issuance
from tests.issuer_support import es256_account, write_config
from tests.conftest import HANG_S

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def veil(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "veil", *args], cwd=REPO_ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_port(path: Path, process: subprocess.Popen) -> int:
    deadline = time.monotonic() + HANG_S
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the issuer did not write its port file: " + process.communicate()[1])
        time.sleep(0.05)
    return int(path.read_text())


def test_add_key_then_serve_issue_and_stop(tmp_path: Path) -> None:
    added = veil("issuer", "--keys", str(tmp_path / "keys"), "--add-key-not-before", "0")
    out, _ = added.communicate(timeout=HANG_S)
    assert added.returncode == 0
    key_id = re.search(r"added token key ([0-9a-f]{64})", out).group(1)

    account = es256_account("alice")
    config = write_config(tmp_path, [account])
    port_file = tmp_path / "issuer.port"
    process = veil("issuer", "--config", str(config), "--keys", str(tmp_path / "keys"),
                   "--listen", "127.0.0.1:0", "--port-file", str(port_file))
    try:
        url = f"http://127.0.0.1:{_wait_for_port(port_file, process)}"
        directory = decode_directory(httpx.get(f"{url}/.well-known/private-token-issuer-directory").content)
        [published] = directory.keys
        assert published.token_key.key_id.hex() == key_id
        pending = begin_issuance(published.token_key, TokenChallenge("issuer.veil.test"))
        answer = httpx.post(f"{url}/token-request", content=pending.request.encode(), headers={
            "content-type": TOKEN_REQUEST_MEDIA_TYPE, "authorization": f"Bearer {account.credential()}"})
        assert answer.status_code == 200
        finish_issuance(pending, answer.content)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=HANG_S)
    assert process.returncode == 0
    assert f"publishing token key {key_id}" in stderr and "veil issuer: serving on 127.0.0.1:" in stderr
    assert "POST" not in stderr and "token-request" not in stderr  # no access log


def test_refuses_to_start_without_keys_or_config_and_help_shows_defaults(tmp_path: Path) -> None:
    no_keys = veil("issuer", "--config", str(write_config(tmp_path, [])), "--keys", str(tmp_path / "none"))
    no_config = veil("issuer", "--config", str(tmp_path / "absent.toml"))
    for process in (no_keys, no_config):
        _, stderr = process.communicate(timeout=HANG_S)
        assert process.returncode == 2 and "veil issuer: cannot start:" in stderr
    helped = veil("issuer", "--help")
    text, _ = helped.communicate(timeout=HANG_S)
    flat = " ".join(text.split())
    for option, default in (("--config", "issuer.toml"), ("--keys", "issuer-keys"), ("--listen", "127.0.0.1:8100")):
        assert option in flat and f"(default: {default})" in flat


def test_the_readmes_issuer_toml_is_a_configuration_the_issuer_loads(tmp_path: Path) -> None:
    """The README's example, with a real key where it shows `...`, loads as written, defaults and all."""
    from issuer.config import load_config

    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    [example] = re.findall(r"```toml\n(issuer_name = .*?)```", readme, flags=re.DOTALL)
    pem = es256_account("alice").public_pem().strip()
    assert example.count('"""-----BEGIN PUBLIC KEY-----\n...\n-----END PUBLIC KEY-----"""') == 1
    (tmp_path / "issuer.toml").write_text(example.replace(
        "-----BEGIN PUBLIC KEY-----\n...\n-----END PUBLIC KEY-----", pem))
    config = load_config(tmp_path / "issuer.toml")
    assert (config.issuer_name, config.tokens_per_period, config.period_s) == ("issuer.example", 1000, 86400)
    assert config.request_uri == "https://issuer.example/token-request"
    assert list(config.accounts) == ["alice"] and config.accounts["alice"].algorithm == "ES256"
