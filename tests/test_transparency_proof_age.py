"""A log outage is reported long before clients refuse the node: while its proof refreshes fail, the node's
stapler emits a `proofs_refreshed` audit event (and so the `veil_node_proof_refreshes` metric) on every
attempt, logs a line, turns not ready (veil.node.v1.Node NOT_SERVING, still alive) once the proofs enter the
last tenth of their allowed age, and retries with backoff.

The log (`log_app` with a real writer and a real witness) runs on a real server and then goes away; time is
the stapler's and the witness's injected clock, so the proofs age by construction, not by waiting."""

from __future__ import annotations

import logging
import random
import re
from types import SimpleNamespace
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from attestation.measurement import Measurement
from attestation.transparency.cosignature import generate_cosigner
from attestation.transparency.node_append import AppendRequest
from attestation.transparency.note import generate_signer
from attestation.transparency.requirement import transparency_requirement
from attestation.transparency.statements import ReleaseStatement, encode_statement
from audit.events import ProofFreshness, ProofRefreshOutcome, ProofsRefreshed
from audit.metrics import Metrics, MetricsSink
from audit.sink import MemorySink
from enclave.health import NODE_SERVICE, NodeHealth
from enclave.cli import _log_proof_refresh
from enclave.transparency import JITTER, RETRY_S, TransparencyStapler, jittered, retry_delay_s
from transparency.apps import log_app, witness_app
from transparency.log import append_entries, init_log
from transparency.witness import Witness
from transparency.writer import LogWriter
from policy.model import TransparencyPolicy, WitnessKey
from tests.http_stand_in import served
from tests.test_ops_health import check
from tests.test_ops_metrics import sample

LOG = generate_signer("log.example/veil")
COSIGNER = generate_cosigner("witness.example")
MEASUREMENT = Measurement(b"\x01" * 32, b"\x02" * 32, b"\x03" * 32)
NODE_ID = "ab" * 16
MAX_AGE_S = 1000
COSIGNED_AT = 1_800_000_000
REQUIREMENT = transparency_requirement(TransparencyPolicy(True, LOG.verifier.encode(), (
    WitnessKey("witness.example", COSIGNER.verifier.encode()),), 1, MAX_AGE_S))
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class UncheckedWriter(LogWriter):
    """The log's writer, taking a node's statement without its evidence: evidence is not this test's subject."""

    def append_node_key(self, request: AppendRequest) -> int:
        with self._lock:
            index = append_entries(self.directory, self.signer, [request.entry]).checkpoint.size - 1
        self.cosign()
        return index


def _release() -> bytes:
    return encode_statement(ReleaseStatement("1.0", MEASUREMENT.code_digest.hex(), MEASUREMENT.policy_digest.hex(),
                                             (MEASUREMENT.model_digest.hex(),)))


def test_a_log_outage_is_reported_before_the_proofs_expire_and_the_node_turns_not_ready(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    init_log(tmp_path / "log", LOG)
    append_entries(tmp_path / "log", LOG, [_release()])
    witness = Witness(COSIGNER, [LOG.verifier], tmp_path / "witness.json", clock=lambda: COSIGNED_AT)
    metrics, now = Metrics(), [COSIGNED_AT + 1.0]
    sink = MetricsSink(MemorySink(), metrics)
    stapler = TransparencyStapler(
        "", MEASUREMENT, lambda: b"a key config", lambda nonce: "{}", key_lifetime_s=3600, refresh_s=60,
        receipt_key=bytes(32), requirement=REQUIREMENT, clock=lambda: now[0],
        on_refresh=lambda outcome, proofs: (sink.emit(ProofsRefreshed(NODE_ID, outcome, proofs)),
                                            lines.append(stapler.failure_line(outcome, proofs))))
    lines: list[tuple[bool, str] | None] = []  # what `veil node` logs of each refresh (the node logs nothing)
    with served(witness_app(witness)) as witness_url:
        writer = UncheckedWriter(tmp_path / "log", LOG, policy=None, witness_urls=(witness_url,))  # type: ignore[arg-type]
        with served(log_app(tmp_path / "log", writer)) as log_url:
            stapler.log_url = log_url
            assert stapler.refresh_quietly() and stapler.ready
    assert stapler.proofs  # stapled, and cosigned at COSIGNED_AT: clients take them until COSIGNED_AT + MAX_AGE_S
    server, health, channel = _health(stapler)
    try:
        seen = []
        for age_s in (MAX_AGE_S * 0.4, MAX_AGE_S * 0.6, MAX_AGE_S * 0.95, MAX_AGE_S + 1):  # the log is gone now
            now[0] = COSIGNED_AT + age_s
            assert not stapler.refresh_quietly()
            health.update()
            seen.append((stapler.freshness, stapler.ready, check(channel), check(channel, NODE_SERVICE)))
    finally:
        channel.close()
        health.stop()
        server.stop(0).wait()
    assert seen == [(ProofFreshness.FRESH, True, SERVING, SERVING), (ProofFreshness.AGING, True, SERVING, SERVING),
                    (ProofFreshness.EXPIRING, False, SERVING, NOT_SERVING),  # alive, but not ready
                    (ProofFreshness.EXPIRED, False, SERVING, NOT_SERVING)]
    events = [(event.outcome, event.proofs) for event in sink.inner.events]  # type: ignore[attr-defined]
    assert events == [(ProofRefreshOutcome.OK, ProofFreshness.FRESH)] + [
        (ProofRefreshOutcome.LOG_UNREACHABLE, freshness) for freshness, *_ in seen]
    exposition = metrics.exposition()
    assert sample(exposition, "veil_node_proof_refreshes_total", outcome="log_unreachable", proofs="aging") == 1
    assert sample(exposition, "veil_node_proof_refreshes_total", outcome="ok", proofs="fresh") == 1
    assert lines[0] is None  # a refresh that worked has no line
    failed = lines[1:]
    assert len(failed) == 4 and all("transparency proofs not refreshed (log_unreachable" in text for _, text in failed)
    assert [serious for serious, _ in failed] == [False, False, True, True]  # warnings, then errors near expiry
    assert "the stapled proofs are aging" in failed[1][1]
    retry = float(re.search(r"retrying in (\d+) s", failed[1][1]).group(1))  # the second retry: 2 x RETRY_S, spread
    assert (1 - JITTER) * 2 * RETRY_S - 1 <= retry <= (1 + JITTER) * 2 * RETRY_S + 1
    assert stapler.failures == 4
    _check_veil_node_logs_the_lines(stapler, caplog)


def _check_veil_node_logs_the_lines(stapler: TransparencyStapler, caplog: pytest.LogCaptureFixture) -> None:
    """`veil node` writes a failed refresh's line to its log: a warning, an error once the proofs are expiring."""
    node = SimpleNamespace(stapler=stapler)
    with caplog.at_level(logging.INFO, logger="veil.node"):
        _log_proof_refresh(node, ProofRefreshOutcome.OK, ProofFreshness.FRESH)
        _log_proof_refresh(node, ProofRefreshOutcome.LOG_UNREACHABLE, ProofFreshness.AGING)
        _log_proof_refresh(node, ProofRefreshOutcome.LOG_UNREACHABLE, ProofFreshness.EXPIRING)
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "veil.node"]
    assert [level for level, _ in records] == [logging.WARNING, logging.ERROR]
    assert all("transparency proofs not refreshed" in text for _, text in records)


def _health(stapler: TransparencyStapler) -> tuple[grpc.Server, NodeHealth, grpc.Channel]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health = NodeHealth(lambda: True, lambda: None, ready=lambda: stapler.ready)
    health.add_to(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    health.start()
    return server, health, grpc.insecure_channel(f"127.0.0.1:{port}")


def test_failed_refreshes_back_off_to_the_regular_interval() -> None:
    assert [retry_delay_s(failures, 60.0) for failures in range(7)] == [60.0, 5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    assert retry_delay_s(10_000, 300.0) == 300.0


def test_nodes_on_the_same_schedule_spread_their_waits_within_the_jitter() -> None:
    """A fleet restarted together, or cut off by one log outage, must not ask the log in step."""
    fleet = [random.Random(seed) for seed in range(32)]
    for delay in (RETRY_S, 40.0, 300.0):
        waits = [jittered(delay, rng) for rng in fleet]
        assert all((1 - JITTER) * delay <= wait <= (1 + JITTER) * delay for wait in waits)
        assert max(waits) - min(waits) > JITTER * delay  # spread across the window, not bunched
