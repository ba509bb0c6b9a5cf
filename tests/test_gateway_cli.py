"""`veil gateway` as a real process: port file, no access log, audit file, clean shutdown, refusal to start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_gateway_support import (  # noqa: F401  (sim_root is a fixture)
    GrpcNode,
    RecordingNode,
    SimEvidence,
    candidate,
    client,
    sim_root,
)
from tests.conftest import HANG_S

REPO_ROOT = Path(__file__).resolve().parents[1]
CANARY = "CANARY-cli-93be-SILVER-HERON"


def veil(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "veil", *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def env(sim_root: Path) -> dict[str, str]:
    return {**os.environ, "VEIL_SIM_ROOT_DIR": str(sim_root), "PYTHONPATH": str(REPO_ROOT)}


@pytest.fixture(scope="module")
def node(sim_root: Path):
    started = GrpcNode(RecordingNode(SimEvidence()))
    yield started
    started.stop()


def wait_for_file(path: Path, process: subprocess.Popen, timeout: float = HANG_S) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the gateway did not write its port file: " + process.communicate()[1])
        time.sleep(0.05)
    return path.read_text()


def test_serves_relays_audits_and_stops_cleanly_without_an_access_log(env, node, tmp_path: Path) -> None:
    port_file, audit_file = tmp_path / "gateway.port", tmp_path / "audit.jsonl"
    process = veil("gateway", "--listen", "127.0.0.1:0", "--node", node.address, "--policy", "dev",
                   "--port-file", str(port_file), "--audit", f"file:{audit_file}", env=env)
    try:
        port = int(wait_for_file(port_file, process))
        with client(f"http://127.0.0.1:{port}") as http:
            assert http.get("/v1/health").json() == {"status": "ok", "nodes": 1}
            answer = http.post("/v1/infer", json={"candidates": [candidate(node.node_id, CANARY.encode())]},
                               headers={"user-agent": CANARY, "x-forwarded-for": "192.0.2.44"})
            assert answer.status_code == 200 and answer.headers["veil-node-id"] == node.node_id
            assert http.post("/v1/infer", content=CANARY.encode()).status_code == 400
            with http.stream("GET", "/v1/health") as health:
                client_port = health.extensions["network_stream"].get_extra_info("client_addr")[1]
    finally:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=HANG_S)
    assert process.returncode == 0
    assert f"serving on 127.0.0.1:{port}" in stderr
    assert "SIMULATED" in stderr  # the dev policy is announced loudly
    for output in (stdout, stderr):
        assert CANARY not in output and "192.0.2.44" not in output
        assert "/v1/infer" not in output and "/v1/health" not in output and str(client_port) not in output
    records = [json.loads(line) for line in audit_file.read_text().splitlines()]
    kinds = [record["kind"] for record in records]
    assert "node_admitted" in kinds and kinds.count("route_decision") == 1
    assert CANARY not in audit_file.read_text() and "192.0.2.44" not in audit_file.read_text()
    route = next(record for record in records if record["kind"] == "route_decision")
    assert route["chosen"] == node.node_id and route["outcome"] == "ok"


def test_refuses_to_start_on_a_bad_policy_or_address(env, tmp_path: Path) -> None:
    missing = veil("gateway", "--listen", "127.0.0.1:0", "--policy", str(tmp_path / "nowhere.toml"), env=env)
    bad_node = veil("gateway", "--listen", "127.0.0.1:0", "--policy", "dev", "--node", "not-an-address", env=env)
    for process in (missing, bad_node):
        _, stderr = process.communicate(timeout=HANG_S)
        assert process.returncode == 2
        assert "veil gateway: cannot start:" in stderr


def test_connection_bounds_are_options_whose_defaults_the_help_shows(env) -> None:
    helped = veil("gateway", "--help", env=env)
    text, _ = helped.communicate(timeout=HANG_S)
    assert helped.returncode == 0
    flat = " ".join(text.split())
    for option, default in (("--accept-timeout-s", "30.0"), ("--header-timeout-s", "10.0"),
                            ("--body-timeout-s", "60.0"), ("--keep-alive-s", "5.0"), ("--max-connections", "1024")):
        assert option in flat and f"(default: {default})" in flat
    refused = veil("gateway", "--listen", "127.0.0.1:0", "--policy", "dev", "--header-timeout-s", "0", env=env)
    _, stderr = refused.communicate(timeout=HANG_S)
    assert refused.returncode == 2 and "header_timeout_s must be a positive number of seconds" in stderr
