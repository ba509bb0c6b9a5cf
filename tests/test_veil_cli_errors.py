"""The `veil` command as a user meets it: a mistake on the command line is a clear message and a non-zero
exit, never a Python traceback, and nothing is written where the user did not ask.

Every test runs the real `veil` command in a subprocess: bad policies, bad and taken ports, folders
that cannot be written, a model folder that does not exist, and help that promises what exists.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.tiny import write_tiny_model
from tests.conftest import REPO_ROOT

# Long enough for a node to self-attest and a fleet to start on a slow machine; a command that serves
# instead of refusing runs into it and fails the test.
COMMAND_TIMEOUT_S = 120


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The test's own simulated root and TMPDIR: whatever a command writes lands in tmp_path."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    return {**os.environ, "VEIL_SIM_ROOT_DIR": str(tmp_path / "sim-root"), "TMPDIR": str(scratch),
            "PYTHONPATH": str(REPO_ROOT)}


def run_veil(*args: str, env: dict[str, str], cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    process = subprocess.Popen([sys.executable, "-m", "veil", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise AssertionError(f"`veil {' '.join(args)}` kept running instead of refusing") from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def assert_refused(result: subprocess.CompletedProcess[str], command: str, *words: str) -> None:
    """Refused with a non-zero exit and a message naming the command and what was wrong; no traceback."""
    assert result.returncode not in (0, None), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"veil {command}: " in result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    """A plain file: a folder below it can never be made."""
    path = tmp_path / "a-file"
    path.write_text("not a folder\n")
    return path


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port some other program listens on, sharing it as SO_REUSEPORT allows: gRPC, which
    sets SO_REUSEPORT by default, would bind beside it and serve half of its connections."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize(("args", "command", "words"), [
    (["chat", "hello", "--policy", "nosuch"], "chat", ["nosuch"]),
    (["proxy", "--policy", "nosuch"], "proxy", ["nosuch"]),
    (["proxy", "--policy", "dev", "--candidates", "99"], "proxy", ["candidates"]),
    (["up", "--nodes", "0"], "up", ["1 to 32 nodes"]),
    (["demo", "--nodes", "0"], "demo", ["1 to 32 nodes"]),
    (["proxy", "--listen", "127.0.0.1:99999", "--policy", "dev"], "proxy", ["HOST:PORT"]),
    (["node", "--model", "tiny", "--listen", "127.0.0.1:99999"], "node", ["HOST:PORT"]),
    (["node", "--model", "tiny", "--listen", "127.0.0.1:-1"], "node", ["HOST:PORT"]),
    (["gateway", "--listen", "127.0.0.1:65536"], "gateway", ["HOST:PORT"]),
    (["relay", "--gateway", "http://127.0.0.1:1", "--listen", "nonsense"], "relay", ["HOST:PORT"]),
    (["issuer", "--config", "no-such-issuer.toml"], "issuer", ["no-such-issuer.toml", "No such file"]),
    (["gateway", "--listen", "127.0.0.1:0", "--policy", "dev", "--spent-tokens", "sqlite:spent.db"], "gateway",
     ["lists none", "--spent-tokens"]),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_a_bad_option_is_a_message_and_a_non_zero_exit(args: list[str], command: str, words: list[str],
                                                       env: dict[str, str], tmp_path: Path) -> None:
    result = run_veil(*args, env=env)
    assert_refused(result, command, *words)
    assert "serving on" not in result.stderr and "OpenAI-compatible API on" not in result.stderr
    assert list((tmp_path / "scratch").iterdir()) == []  # refused before anything was written


@pytest.mark.parametrize("command", [
    ["model", "init-tiny", "{file}/model"],
    ["issuer", "--keys", "{file}/keys", "--add-key-not-before", "0"],
    ["gateway", "--listen", "127.0.0.1:0", "--policy", "dev", "--port-file", "{file}/gateway.port"],
    ["relay", "--gateway", "http://127.0.0.1:1", "--listen", "127.0.0.1:0", "--port-file", "{file}/relay.port"],
    ["node", "--model", "tiny", "--policy", "dev", "--port-file", "{file}/node.port"],
    ["up", "--nodes", "1", "--workdir", "{file}/fleet"],
], ids=lambda value: " ".join(value[:2]))
def test_a_folder_that_cannot_be_written_is_a_message_not_a_traceback(command: list[str], env: dict[str, str],
                                                                        a_file: Path) -> None:
    args = [part.replace("{file}", str(a_file)) for part in command]
    name = " ".join(args[:2]) if args[0] == "model" else args[0]
    assert_refused(run_veil(*args, env=env), name, str(a_file))
    assert a_file.read_text() == "not a folder\n"


# Each command that verifies under `strict` unless told otherwise; a closed gateway port: nothing is contacted.
STRICT_BY_DEFAULT = {
    "chat": ["chat", "hello", "--gateway", "http://127.0.0.1:9"],
    "proxy": ["proxy", "--gateway", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"],
    "gateway": ["gateway", "--listen", "127.0.0.1:0", "--port-file", "{tmp}/gateway.port"],
}


@pytest.mark.parametrize("command", STRICT_BY_DEFAULT)
def test_a_command_defaulting_to_strict_refuses_it_unfilled_at_start_naming_each_empty_key(
        command: str, env: dict[str, str], tmp_path: Path) -> None:
    args = [part.replace("{tmp}", str(tmp_path)) for part in STRICT_BY_DEFAULT[command]]
    result = run_veil(*args, env=env)
    assert result.returncode == 2, result.stderr
    assert_refused(result, command, "policy 'strict'", "transparency.log_key", "transparency.witnesses[0].key",
                   "transparency.witnesses[1].key", "transparency.witnesses[2].key", "`veil policy check FILE`",
                   'README.md, "Deploying on confidential-computing nodes"')
    assert "OpenAI-compatible API on" not in result.stderr and not (tmp_path / "gateway.port").exists()


def test_a_taken_port_is_refused_by_the_node_and_the_proxy_before_any_banner(env: dict[str, str], tmp_path: Path,
                                                                            held_port: int) -> None:
    model = write_tiny_model(tmp_path / "tiny")
    node = run_veil("node", "--model", str(model), "--policy", "dev", "--attestation", "sim",
                    "--listen", f"127.0.0.1:{held_port}", "--audit", "none", env=env)
    assert_refused(node, "node", f"cannot listen on 127.0.0.1:{held_port}", "taken")
    assert "serving on" not in node.stderr
    proxy = run_veil("proxy", "--policy", "dev", "--listen", f"127.0.0.1:{held_port}", env=env)
    assert_refused(proxy, "proxy", f"cannot listen on 127.0.0.1:{held_port}")
    assert "OpenAI-compatible API on" not in proxy.stderr  # no banner for a server that never served


def test_pooling_without_the_embed_task_is_refused_by_name_before_any_banner(env: dict[str, str],
                                                                           tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny")
    node = run_veil("node", "--model", str(model), "--policy", "dev", "--attestation", "sim", "--pooling", "mean",
                    "--audit", "none", env=env)  # --task left at its default, generate
    assert_refused(node, "node", "--pooling applies to --task embed only", "--task embed")
    assert "serving on" not in node.stderr


def test_up_with_a_model_folder_that_does_not_exist_writes_nothing_there(env: dict[str, str],
                                                                         tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = run_veil("up", "--nodes", "1", "--gateway-port", "0", "--model", str(missing), env=env)
    assert_refused(result, "up", str(missing))
    assert not missing.exists()  # the random tiny model is never written, nor served, in the user's place


def test_model_help_promises_only_what_exists(env: dict[str, str]) -> None:
    listing = run_veil("--help", env=env)
    [line] = [line for line in listing.stdout.splitlines() if line.split()[:1] == ["model"]]
    assert "inspect" not in line and "init-tiny" in line
    helped = run_veil("model", "--help", env=env)
    assert helped.returncode == 0
    actions = helped.stdout.split("ACTION", 2)[-1].split("options:")[0].split()
    assert actions[0] == "init-tiny" and "inspect" not in helped.stdout


def test_attest_probe_names_the_option_by_its_current_name(env: dict[str, str]) -> None:
    result = run_veil("attest", "probe", env=env)
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "sim: always available" in result.stdout
    assert "--backend" not in result.stdout + result.stderr
