"""`grpc.health.v1` for a node, as Kubernetes' gRPC probes and load balancers ask it.

A node answers SERVING only while three things hold: its engine core runs, its evidence is fresh
(a self-attestation over a fresh nonce passed within the last two check intervals), and it is not
draining. Anything else is NOT_SERVING, for the whole server ("") and for `veil.node.v1.Node` alike.
`veil.node.v1.Node` is also NOT_SERVING while `ready` says no (the transparency proofs the node staples
are about to expire, so clients are about to refuse it): not ready, yet alive, for a restart would not
bring the log back. A readiness probe asks for that service, a liveness probe for "".
The core's death is pushed here by the engine client's exit callback; a watcher thread polls the
same conditions a few times a second as a backstop, so a dead core reads NOT_SERVING well within
a second whichever way it is noticed. The answer carries a status and nothing else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

NODE_SERVICE = "veil.node.v1.Node"
SERVICES = ("", NODE_SERVICE)
POLL_S = 0.2
DEFAULT_EVIDENCE_CHECK_S = 300.0


class NodeHealth:
    """The node's health status, kept true by a watcher thread; `add_to` serves it on a gRPC server."""

    def __init__(self, core_alive: Callable[[], bool], check_evidence: Callable[[], None],
                 evidence_check_s: float = DEFAULT_EVIDENCE_CHECK_S, poll_s: float = POLL_S,
                 ready: Callable[[], bool] = lambda: True) -> None:
        self._core_alive = core_alive
        self._ready = ready
        self._check_evidence = check_evidence
        self._evidence_check_s = evidence_check_s
        self._poll_s = poll_s
        self._servicer = health.HealthServicer()
        self._draining = False
        self._evidence_ok_at: float | None = None
        self._stopped = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)  # until started: nothing is up yet

    def add_to(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def start(self, evidence_checked: bool = True) -> None:
        """Start watching; `evidence_checked` says the node has just passed its self-attestation."""
        if evidence_checked:
            self._evidence_ok_at = time.monotonic()
        self.update()
        self._watcher = threading.Thread(target=self._watch, name="veil-health", daemon=True)
        self._watcher.start()

    def drain(self) -> None:
        """Stop admitting for good: NOT_SERVING from now on."""
        self._draining = True
        self.update()

    @property
    def serving(self) -> bool:
        return not self._draining and self._core_alive() and self._evidence_fresh(time.monotonic())

    def update(self) -> None:
        """Publish the status the conditions give now (called on every change and by the watcher)."""
        with self._lock:
            serving = self.serving
            self._servicer.set("", _status(serving))
            self._servicer.set(NODE_SERVICE, _status(serving and self._ready()))

    def stop(self) -> None:
        """NOT_SERVING for good (watchers are told so) and the watcher ends."""
        self._stopped.set()
        self._draining = True
        self._servicer.enter_graceful_shutdown()
        if self._watcher is not None:
            self._watcher.join(5)

    def _evidence_fresh(self, now: float) -> bool:
        return self._evidence_ok_at is not None and now - self._evidence_ok_at <= 2 * self._evidence_check_s

    def _watch(self) -> None:
        next_check = time.monotonic() + self._evidence_check_s
        while not self._stopped.wait(self._poll_s):
            if time.monotonic() >= next_check and not self._draining:
                self._refresh_evidence()
                next_check = time.monotonic() + self._evidence_check_s
            self.update()

    def _refresh_evidence(self) -> None:
        try:
            self._check_evidence()
        except Exception:  # noqa: BLE001 - any failure means the evidence is not fresh; the type is all it says
            return  # the previous success ages out; the node reads NOT_SERVING once it is two intervals old
        self._evidence_ok_at = time.monotonic()

    def _set(self, status: int) -> None:
        for service in SERVICES:
            self._servicer.set(service, status)


def _status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
