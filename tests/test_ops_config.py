"""Options from a TOML file (flags override), the node's engine limits, and structured logs without content."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enclave.errors import SelfCheckError
from enclave.node import engine_config
from enclave.selfcheck import EngineLimits, check_node_settings
from enclave.settings import NodeSettings
from policy import shipped_policy
from tests.conftest import HANG_S, REPO_ROOT
from veil.cli import build_parser, main
from veil.config_file import ConfigFileError, apply_config_file


def parsed(argv: list[str]):
    parser = build_parser()
    apply_config_file(parser, argv)
    return parser.parse_args(argv)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_node_options_come_from_the_file_and_flags_override_them(tmp_path: Path) -> None:
    config = write(tmp_path / "node.toml", 'model = "/models/tiny"\nlisten = "127.0.0.1:7001"\ncapacity = 4\n'
                   'drain-s = 45\nmax_model_len = 512\neager = true\nlog-format = "json"\n')
    args = parsed(["node", "--config", str(config), "--capacity", "2"])
    assert args.model == Path("/models/tiny") and args.listen == "127.0.0.1:7001"
    assert args.capacity == 2  # the flag wins
    assert args.drain_s == 45.0 and args.max_model_len == 512 and args.eager is True and args.log_format == "json"
    assert parsed(["node", "--model", "/m"]).capacity == 16  # no file: the command's own defaults


def test_gateway_and_relay_options_come_from_the_file(tmp_path: Path) -> None:
    config = write(tmp_path / "gateway.toml", 'node = ["10.0.0.1:7001", "10.0.0.2:7001"]\npolicy = "dev"\n'
                   'node-dns = "veil-node.veil-nodes.svc:7001"\nhealth-s = 1.5\n')
    args = parsed(["gateway", "--config", str(config)])
    assert args.node == ["10.0.0.1:7001", "10.0.0.2:7001"] and args.policy == "dev" and args.health_s == 1.5
    assert args.node_dns == ["veil-node.veil-nodes.svc:7001"]
    relay = write(tmp_path / "relay.toml", 'gateway = "http://127.0.0.1:8000"\nmax-in-flight = 9\n')
    args = parsed(["relay", f"--config={relay}"])
    assert args.gateway == "http://127.0.0.1:8000" and args.max_in_flight == 9


def test_the_issuer_reads_its_options_from_the_serve_table(tmp_path: Path) -> None:
    config = write(tmp_path / "issuer.toml", 'issuer_name = "issuer.test"\n[serve]\nlisten = "127.0.0.1:8100"\n'
                   'keys = "/keys"\n')
    args = parsed(["issuer", "--config", str(config), "--keys", "/other"])
    assert args.listen == "127.0.0.1:8100" and args.keys == Path("/other")


@pytest.mark.parametrize(("text", "names"), [
    ('modle = "/m"\n', "'modle' is not an option of veil node"),
    ('capacity = "four"\n', "'capacity' must be a number"),
    ('capacity = 2.5\n', "'capacity' must be a whole number"),
    ('eager = "yes"\n', "'eager' is a switch"),
    ('attestation = "sgx"\n', "'attestation' must be one of sim, nvml, tsm"),
    ('config = "other.toml"\n', "'config' is not an option"),
    ('model = [\n', "is not valid TOML"),
])
def test_a_bad_file_is_refused_naming_the_key_not_its_value(tmp_path: Path, text: str, names: str) -> None:
    config = write(tmp_path / "node.toml", text)
    with pytest.raises(ConfigFileError) as refused:
        parsed(["node", "--config", str(config)])
    assert names in str(refused.value) and "four" not in str(refused.value) and "sgx" not in str(refused.value)


def test_a_missing_file_is_a_clear_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["node", "--config", str(tmp_path / "absent.toml")]) == 2
    assert "cannot read the options file" in capsys.readouterr().err


# ----- the node's engine limits ---------------------------------------------------------------------


def node_settings(tmp_path: Path, **values) -> NodeSettings:
    (tmp_path / "config.json").write_text("{}")
    return NodeSettings(model=tmp_path, policy="dev", attestation="sim", **values)


def test_the_engine_limits_reach_the_engine_config(tmp_path: Path) -> None:
    settings = node_settings(tmp_path, capacity=4, max_model_len=256, gpu_memory_utilization=0.5,
                             max_num_seqs=8, max_num_batched_tokens=512)
    limits = check_node_settings(settings, shipped_policy("dev"), b"\0" * 32)
    config = engine_config(settings, limits)
    assert (config.max_model_len, config.gpu_memory_utilization, config.max_num_seqs,
            config.max_num_batched_tokens) == (256, 0.5, 8, 512)
    default = engine_config(node_settings(tmp_path), EngineLimits(max_model_len=1024, kv_cache_gib=0.1))
    assert default.max_num_seqs == 64 and default.max_num_batched_tokens == 1024 and default.max_model_len == 1024


@pytest.mark.parametrize(("values", "names"), [
    ({"max_model_len": 10**9}, "max_context_tokens"),
    ({"max_num_seqs": 2, "capacity": 4}, "--max-num-seqs must be at least --capacity"),
    ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
])
def test_limits_beyond_the_policy_or_the_capacity_are_refused(tmp_path: Path, values, names: str) -> None:
    with pytest.raises(SelfCheckError) as refused:
        check_node_settings(node_settings(tmp_path, **values), shipped_policy("dev"), b"\0" * 32)
    assert names in str(refused.value)


def test_veil_node_help_lists_the_serving_limits() -> None:
    done = subprocess.run([sys.executable, "-m", "veil", "node", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT)
    for flag in ("--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens",
                 "--config", "--log-format", "--drain-s", "--metrics-listen"):
        assert flag in done.stdout


# ----- structured logs ---------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_gateway_logs_json_lines_with_time_and_level_and_names_an_unreachable_node(tmp_path: Path) -> None:
    silent = f"127.0.0.1:{closed_port()}"
    config = write(tmp_path / "gateway.toml", f'policy = "dev"\nlisten = "127.0.0.1:0"\nnode = ["{silent}"]\n'
                   f'port-file = "{tmp_path / "port"}"\nhealth-s = 0.5\n')
    process = subprocess.Popen([sys.executable, "-m", "veil", "gateway", "--config", str(config), "--log-format", "json"],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + HANG_S
        while not (tmp_path / "port").exists():
            assert process.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.05)
        time.sleep(1.5)  # a few health rounds: the silent node is still named once only
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=HANG_S)
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    assert lines and all(set(line) >= {"time", "level", "logger", "message"} for line in lines)
    assert all(line["time"].endswith("Z") and line["level"] in ("info", "warning", "error") for line in lines)
    named = [line for line in lines if silent in line["message"]]
    assert len(named) == 1 and named[0]["level"] == "warning" and "does not answer" in named[0]["message"]
    assert any("serving on 127.0.0.1:" in line["message"] for line in lines)


def test_veil_logs_go_to_the_stderr_of_the_moment_they_are_written(capsys: pytest.CaptureFixture[str]) -> None:
    """A process that swaps its stderr after logging was configured (a capture, a daemon's redirect) must
    not log into the closed old stream: logging's own error report is a traceback of the caller's source."""
    import io
    import logging

    from audit.logs import configure_logging

    first = io.StringIO()
    sys.stderr, saved = first, sys.stderr
    try:
        configure_logging("text")
        first.close()
        sys.stderr = second = io.StringIO()
        logging.getLogger("veil.client").warning("veil client: a warning after the swap")
    finally:
        sys.stderr = saved
    assert "a warning after the swap" in second.getvalue()
    assert "Logging error" not in second.getvalue() + capsys.readouterr().err
