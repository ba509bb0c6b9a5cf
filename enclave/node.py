"""The node process: policy, self-checks, keys, evidence, engine, gRPC service and audit, wired together."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from concurrent import futures
from pathlib import Path

import grpc

from attestation.backends import get_backend
from attestation.bundle import EvidenceBundle
from attestation.measurement import measure
from attestation.receipts import ReceiptSigner
from attestation.transparency.client_check import TransparencyRequirement
from attestation.transparency.errors import TransparencyError
from attestation.transparency.requirement import transparency_requirement
from attestation.verifier import node_id_for, verify
from audit.buckets import bucket_latency_ms, bucket_tokens
from audit.events import (
    AttestationBackend,
    BlocksZeroed,
    EvidenceOutcome,
    EvidenceRefreshed,
    NodeStarted,
    NodeStopped,
    ProofFreshness,
    ProofRefreshOutcome,
    ProofsRefreshed,
    RequestFinished,
    RequestStatus,
    StopReason,
)
from audit.metrics import Metrics, MetricsServer, MetricsSink, serve_metrics
from audit.sink import open_sink
from enclave.api import InnerApi
from enclave.health import NodeHealth
from enclave.keys import NodeKeys
from enclave.selfcheck import EngineLimits, check_node_settings
from enclave.service import NodeService, Outcome
from enclave.settings import NodeSettings
from enclave.transparency import TransparencyStapler
from engine import EngineConfig, EngineCoreClient, PoolingKind, Tokenizer, ZeroingReport, model_pooling
from policy import resolve_policy
from policy.model import Policy
from policy.shipped import resolve_policy_path
from protocol import node_pb2_grpc
from protocol.constants import MAX_GRPC_MESSAGE_BYTES

RELEASE = "0.1.0"
# A BlocksZeroed event sums at least a second of zeroing and, unless a minute passes first, the
# blocks of several requests: one request's exact block count would tell its length.
ZEROED_REPORT_INTERVAL_S = 1.0
ZEROED_REPORT_MIN_REQUESTS = 4
ZEROED_REPORT_MAX_S = 60.0


@dataclass(slots=True)
class ZeroingTally:
    """Blocks zeroed (and residue found among them) since the last BlocksZeroed event."""

    blocks: int = 0
    residue: int = 0
    last_step: int = 0
    requests: int = 0  # requests that ended (and released blocks) within the tally
    since: float = field(default_factory=time.monotonic)

    def add(self, blocks: int, residue: int, step: int, requests: int = 0) -> None:
        self.blocks += blocks
        self.residue += residue
        self.last_step = step
        self.requests += requests

    def due(self, now: float) -> bool:
        """Whether to report now: residue at once (a red line waits for nothing), else when the
        tally covers a second and several requests, or a minute whatever it covers."""
        age = now - self.since
        if self.residue or age >= ZEROED_REPORT_MAX_S:
            return True
        return age >= ZEROED_REPORT_INTERVAL_S and self.requests >= ZEROED_REPORT_MIN_REQUESTS


def request_tokenizer(settings: NodeSettings, policy: Policy) -> Tokenizer:
    """The tokenizer requests' text is encoded with: control tokens it spells are text, unless the policy allows."""
    return Tokenizer(settings.model, control_tokens_in_content=policy.engine.control_tokens_in_content)


def engine_config(settings: NodeSettings, limits: EngineLimits) -> EngineConfig:
    """The node's engine: the policy's limits; graphs and async steps where CUDA has them unless turned off."""
    optional = {name: value for name in ("gpu_memory_utilization", "max_num_batched_tokens")
                if (value := getattr(settings, name)) is not None}  # unset: the engine's own defaults
    return EngineConfig(
        kv_cache_gib=limits.kv_cache_gib, max_model_len=limits.max_model_len,
        max_num_seqs=settings.max_num_seqs or max(64, settings.capacity), dtype=settings.dtype,
        cuda_graphs=None if settings.cuda_graphs else False,
        async_scheduling=None if settings.async_scheduling else False, bridge_toll_us=settings.bridge_toll_us,
        speculative=settings.speculative, num_speculative_tokens=settings.num_speculative_tokens,
        sampling_draw=settings.sampling_draw, **optional,
    )


def node_pooling(settings: NodeSettings) -> PoolingKind | None:
    """An embedding node's pooling (`--task embed`): the operator's, else the model folder's, else last-token."""
    if settings.task != "embed":
        return None
    if settings.pooling is not None:
        return PoolingKind(settings.pooling)
    return model_pooling(settings.model) or PoolingKind.LAST


class NodeServer:
    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.policy = resolve_policy(settings.policy)
        self.measurement = measure(policy_path=resolve_policy_path(settings.policy), model_dir=settings.model,
                                   draft_dir=settings.draft_model)
        limits = check_node_settings(settings, self.policy, self.measurement.model_digest)
        self.backend = get_backend(settings.attestation, policy=self.policy)
        # Signs every answer's receipt; bound into each evidence, kept in memory only, for the process's life.
        self.receipts = ReceiptSigner.generate()
        self.keys = NodeKeys(settings.key_rotation_s, settings.key_grace_s, on_rotate=self._key_rotated)
        self.stapler = None if settings.transparency_log is None else TransparencyStapler(
            settings.transparency_log, self.measurement, lambda: self.keys.current.config.encode(), self._attest,
            settings.key_rotation_s + settings.key_grace_s if settings.key_rotation_s > 0 else 0,
            settings.transparency_refresh_s, self.receipts.public_key, _requirement(self.policy),
            on_refresh=self._proofs_refreshed)
        # Set by `veil node` to write each failed refresh's line to the operator's log: the node logs nothing.
        self.on_proofs_refreshed: Callable[[ProofRefreshOutcome, ProofFreshness], None] | None = None
        # The operator's --audit overrides the sink the measured policy names.
        # Metrics count the audit events as they are emitted, so they hold nothing the audit does not.
        self.metrics = Metrics()
        self.audit = MetricsSink(open_sink(settings.audit if settings.audit is not None else self.policy.audit.sink),
                                 self.metrics)
        self.metrics_server: MetricsServer | None = None
        # The engine core runs in a process of its own: the serving threads below never stall its steps.
        self.engine = EngineCoreClient(settings.model, engine_config(settings, limits), on_zeroing=self._tally_zeroed)
        self._zeroed = ZeroingTally()
        self._zeroed_lock = threading.Lock()
        self.engine.on_exit(self._engine_lost)
        api = InnerApi(self.engine, request_tokenizer(settings, self.policy), settings.model_name or Path(settings.model).name,
                       aliases=settings.model_aliases, tool_call_format=settings.tool_call_format,
                       pooling=node_pooling(settings))
        # grpc.health.v1: SERVING only while the core runs, the evidence is fresh and the node is not draining.
        self.health = NodeHealth(lambda: self.engine.alive, self.self_attest, settings.evidence_check_s,
                                 ready=lambda: self.stapler is None or self.stapler.ready)
        self.service = NodeService(
            keyring=lambda: self.keys.keyring, api=api, attest=self._attest, node_id=lambda: self.node_id,
            sign_receipt=self._sign_receipt,
            transparency=lambda: "" if self.stapler is None else self.stapler.proofs,
            capacity=settings.capacity, on_finished=self._audit_request, healthy=lambda: self.health.serving,
        )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=settings.capacity + 8, thread_name_prefix="veil-rpc"),
            options=[("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
                     # gRPC shares ports by default: a second node on a taken port would start and
                     # take half of the first one's connections. A taken port is refused instead.
                     ("grpc.so_reuseport", 0)],
        )
        node_pb2_grpc.add_NodeServicer_to_server(self.service, self._server)
        self.health.add_to(self._server)
        self.metrics.gauge("veil_node_in_flight", lambda: self.service.in_flight)
        self.metrics.gauge("veil_node_capacity", lambda: settings.capacity)
        self.port: int | None = None

    @property
    def node_id(self) -> str:
        return node_id_for(self.keys.current.config.encode(), self.measurement)

    def self_attest(self) -> None:
        """Collects evidence over a fresh nonce and verifies it under the node's own policy.

        A node whose platform (CC off, debug on), code, weights or policy would not pass a client's
        verification refuses to start, rather than serve and be refused request by request.
        """
        nonce = os.urandom(32)
        bundle = EvidenceBundle.from_json(self._attest(nonce))
        verify(bundle, self.policy, expected_nonce=nonce)

    def start(self) -> int:
        self.self_attest()
        try:
            self.port = self._server.add_insecure_port(self.settings.listen)
        except RuntimeError:  # what gRPC raises for a port it cannot bind (older versions returned 0)
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {self.settings.listen}: the port is taken or the address is not "
                          "this machine's; choose another")
        if self.settings.metrics_listen is not None:  # bound before the model loads: a taken port fails fast
            self.metrics_server = serve_metrics(self.metrics, self.settings.metrics_listen)
        self.engine.start()  # loads the model; only a node that passed its self-checks spends that time
        if self.stapler is not None:  # proofs before the first Attest, so the gateway lists them from the start
            self.stapler.refresh_quietly()
            self.stapler.start()
        self.keys.start()
        self._server.start()
        self.health.start()  # self_attest above is its first fresh evidence
        backend = AttestationBackend(getattr(self.backend, "name", self.settings.attestation or "sim"))
        self.audit.emit(NodeStarted(self.node_id, self.policy.digest.hex(), RELEASE, backend))
        # Durable before anyone is told the node is up: operators map node ids to processes by it.
        self.audit.flush()
        if self.settings.port_file is not None:
            _write_atomically(Path(self.settings.port_file), f"{self.port}\n")
        return self.port

    def rotate_key(self) -> None:
        self.keys.rotate()

    def _key_rotated(self) -> None:
        if self.stapler is not None:
            self.stapler.key_rotated()

    def drain(self, drain_s: float) -> bool:
        """Stop admitting (health NOT_SERVING, new requests refused as never taken) and wait up to
        `drain_s` for the requests in flight to finish; True if they all did."""
        self.service.serving = False
        self.health.drain()
        deadline = time.monotonic() + drain_s
        while self.service.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.service.in_flight == 0

    def stop(self, grace: float = 1.0) -> None:
        self.service.serving = False
        self.health.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self._server.stop(grace).wait()
        self.engine.stop()  # its last zeroing report arrives before this returns
        self._flush_zeroed()
        self.keys.stop()
        if self.stapler is not None:
            self.stapler.stop()
        self.audit.emit(NodeStopped(self.node_id, StopReason.SHUTDOWN))
        self.audit.close()

    def wait(self) -> None:
        self._server.wait_for_termination()

    # ----- evidence and audit -------------------------------------------------------------------

    def _attest(self, nonce: bytes) -> str:
        try:
            bundle = self.backend.collect(self.keys.current.config.encode(), self.measurement, nonce,
                                          self.receipts.public_key)
        except Exception:
            self.audit.emit(EvidenceRefreshed(self.node_id, EvidenceOutcome.BACKEND_ERROR))
            raise
        self.audit.emit(EvidenceRefreshed(self.node_id, EvidenceOutcome.OK))
        return bundle.to_json()

    def _sign_receipt(self, request: bytes, body_sha256: bytes, status: int) -> bytes:
        return self.receipts.sign(request, body_sha256, status, self.measurement, time.time())

    def _proofs_refreshed(self, outcome: ProofRefreshOutcome, proofs: ProofFreshness) -> None:
        self.audit.emit(ProofsRefreshed(self.node_id, outcome, proofs))
        if self.on_proofs_refreshed is not None:
            self.on_proofs_refreshed(outcome, proofs)

    def _tally_zeroed(self, report: ZeroingReport) -> None:
        """Adds the core's report to the tally and emits the tally when it is due (on the reader thread).

        Aggregating over time and requests keeps the count from telling one request's length.
        """
        with self._zeroed_lock:
            self._zeroed.add(report.blocks, report.residue, report.step, report.requests_ended)
            if self._zeroed.due(time.monotonic()):
                self._flush_zeroed()

    def flush_audit(self) -> None:
        """Takes the core's zeroing tally now, emits what is pending and flushes the sink."""
        if self.engine.alive:
            self._tally_zeroed(self.engine.take_zeroing())
        with self._zeroed_lock:
            self._flush_zeroed()
        self.audit.flush()

    def _flush_zeroed(self) -> None:
        tally, self._zeroed = self._zeroed, ZeroingTally()
        if tally.blocks:
            self.audit.emit(BlocksZeroed(self.node_id, tally.last_step, tally.blocks, tally.residue))

    def _engine_lost(self) -> None:
        """The engine core died: this node can serve nobody, so it says so to health checks at once."""
        if hasattr(self, "service"):
            self.service.serving = False
            self.health.update()
        self.audit.emit(NodeStopped(self.node_id, StopReason.ENGINE_ERROR))
        self.audit.flush()

    def _audit_request(self, outcome: Outcome) -> None:
        now = time.monotonic()
        ttft = None if outcome.first_byte is None else bucket_latency_ms((outcome.first_byte - outcome.started) * 1000)
        self.audit.emit(RequestFinished(
            self.node_id, RequestStatus(outcome.status),
            bucket_tokens(outcome.prompt_tokens), bucket_tokens(outcome.output_tokens),
            bucket_latency_ms((now - outcome.started) * 1000), ttft,
        ))


def _requirement(policy: Policy) -> TransparencyRequirement | None:
    """How old the policy lets stapled proofs be (None: it requires none, or names no log yet)."""
    try:
        return transparency_requirement(policy.transparency)
    except TransparencyError:  # required, but no log named: no node passes, and no proof has an age to watch
        return None


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".port-")
    with os.fdopen(handle, "w") as stream:
        stream.write(text)
    os.replace(temporary, path)
