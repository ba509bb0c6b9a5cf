"""The SDK sends nothing to a node it has not verified: checked against a real HTTP server that
lists real simulated evidence and counts every byte posted to its infer endpoint."""

from __future__ import annotations

import base64
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi import FastAPI, Request, Response

from attestation.backends.sim import SimBackend
from attestation.measurement import Measurement
from attestation.sim_root import ROOT_DIR_ENV
from attestation.verifier import node_id_for
from client.directory import DirectoryEntry
from client.errors import GatewayError, NoVerifiedNodeError
from client.sdk import Client
from ohttp import generate_key_pair
from policy import shipped_policy
from tests.http_stand_in import environment, served
from tests.policy_support import filled_strict
from tests.test_attestation_support import RECEIPT_KEY
from tests.test_gateway_support import with_broken_certificate


@dataclass
class StandIn:
    """A gateway stand-in: a fixed directory, and a record of what reached /v1/infer."""

    directory: dict
    infer_bodies: list[bytes] = field(default_factory=list)
    url: str = ""
    retry_after: str = "2"


def _node(root: Path) -> dict:
    config = generate_key_pair(1).config.encode()
    measurement = Measurement(secrets.token_bytes(32), shipped_policy("dev").digest, secrets.token_bytes(32))
    bundle = SimBackend(root).collect(config, measurement, secrets.token_bytes(32), RECEIPT_KEY)
    return {"node_id": node_id_for(config, measurement), "key_config": base64.b64encode(config).decode(),
            "evidence": bundle.to_json(), "capacity": 4, "attestation_result": ""}


def _app(stand_in: StandIn) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/nodes")
    def nodes() -> dict:
        return stand_in.directory

    @app.post("/v1/infer")
    async def infer(request: Request) -> Response:
        stand_in.infer_bodies.append(await request.body())
        return Response('{"error": {"code": "overloaded", "message": "busy"}}', status_code=503,
                        media_type="application/json", headers={"retry-after": stand_in.retry_after})

    return app


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    root = tmp_path_factory.mktemp("refusal")
    trusted, untrusted = _node(root / "trusted-root"), _node(root / "other-root")
    server_state = StandIn({"version": 1, "nodes": [trusted, untrusted], "policy_digest": ""})
    with served(_app(server_state)) as url, environment(ROOT_DIR_ENV, str(root / "trusted-root")):
        server_state.url = url
        yield server_state


def _ask(client: Client) -> None:
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "secret question"}])


def test_nothing_is_sent_when_no_candidate_verifies(stand_in: StandIn) -> None:
    before = len(stand_in.infer_bodies)
    with Client(stand_in.url, policy=filled_strict()) as client, pytest.raises(NoVerifiedNodeError) as caught:
        _ask(client)
    assert len(stand_in.infer_bodies) == before
    failures = caught.value.failures
    assert len(failures) == 2 and {f.check for f in failures} == {"simulated"}
    assert "secret question" not in str(caught.value) and "nothing was sent" in str(caught.value)


def test_only_verified_candidates_are_encrypted_to(stand_in: StandIn) -> None:
    trusted, untrusted = (node["node_id"] for node in stand_in.directory["nodes"])
    before = len(stand_in.infer_bodies)
    with Client(stand_in.url, policy="dev", max_retries=0) as client, pytest.raises(GatewayError) as caught:
        _ask(client)
    assert caught.value.status == 503 and caught.value.code == "overloaded" and caught.value.retry_after == 2.0
    [body] = stand_in.infer_bodies[before:]
    candidates = json.loads(body)["candidates"]
    assert [c["node_id"] for c in candidates] == [trusted]
    assert untrusted not in body.decode()
    assert b"secret question" not in body


def test_a_directory_that_lies_about_node_ids_is_refused(stand_in: StandIn) -> None:
    original = stand_in.directory
    swapped = [dict(node) for node in original["nodes"]]
    swapped[0]["node_id"], swapped[1]["node_id"] = swapped[1]["node_id"], swapped[0]["node_id"]
    stand_in.directory = {**original, "nodes": swapped}
    before = len(stand_in.infer_bodies)
    try:
        with Client(stand_in.url, policy="dev") as client, pytest.raises(NoVerifiedNodeError) as caught:
            _ask(client)
    finally:
        stand_in.directory = original
    assert len(stand_in.infer_bodies) == before
    assert {f.check for f in caught.value.failures} == {"directory", "chain"}


def test_an_overloaded_gateway_is_asked_again_after_its_retry_after_then_the_error_is_raised(
        stand_in: StandIn) -> None:
    stand_in.retry_after = "0.05"
    try:
        before = len(stand_in.infer_bodies)
        with Client(stand_in.url, policy="dev", max_retries=2) as client, pytest.raises(GatewayError) as caught:
            _ask(client)
        assert caught.value.status == 503 and len(stand_in.infer_bodies) - before == 3  # the first and 2 retries
        bodies = [json.loads(body)["candidates"][0]["encapsulated"] for body in stand_in.infer_bodies[before:]]
        assert len(set(bodies)) == 3  # each attempt sealed afresh: nothing links them but timing
    finally:
        stand_in.retry_after = "2"


def test_a_retry_after_longer_than_the_sdk_waits_is_left_to_the_caller(stand_in: StandIn) -> None:
    stand_in.retry_after = "3600"
    try:
        before = len(stand_in.infer_bodies)
        with Client(stand_in.url, policy="dev", max_retries=5) as client, pytest.raises(GatewayError) as caught:
            _ask(client)
        assert caught.value.retry_after == 3600.0 and len(stand_in.infer_bodies) - before == 1
    finally:
        stand_in.retry_after = "2"


# ----- evidence that breaks the verifier gets only its candidate refused --------------------------


def _broken_node() -> dict:
    """A node under the trusted root whose GPU leaf certificate declares an X.509 version that does not exist."""
    node = _node(Path(os.environ[ROOT_DIR_ENV]))
    return {**node, "evidence": with_broken_certificate(node["evidence"], "gpu")}


def _entry(node: dict) -> DirectoryEntry:
    return DirectoryEntry(node["node_id"], base64.b64decode(node["key_config"]), node["evidence"], node["capacity"])


def test_a_candidate_whose_evidence_breaks_the_verifier_is_skipped_and_the_others_sealed_to(stand_in: StandIn) -> None:
    original = stand_in.directory
    trusted, broken = original["nodes"][0], _broken_node()
    stand_in.directory = {**original, "nodes": [broken, trusted]}
    before = len(stand_in.infer_bodies)
    try:
        with Client(stand_in.url, policy="dev", max_retries=0) as client, pytest.raises(GatewayError) as caught:
            _ask(client)
    finally:
        stand_in.directory = original
    assert caught.value.code == "overloaded"  # the stand-in's answer: the request was sent
    [body] = stand_in.infer_bodies[before:]
    assert [c["node_id"] for c in json.loads(body)["candidates"]] == [trusted["node_id"]]


def test_fresh_evidence_that_breaks_the_verifier_is_a_failed_check(stand_in: StandIn) -> None:
    from client.verify import CandidateVerifier

    broken = _broken_node()
    record = CandidateVerifier(shipped_policy("dev")).check_fresh(_entry(broken), broken["evidence"], secrets.token_bytes(32))
    assert not record.ok and record.failed_check and record.failure


def test_whatever_the_verifier_raises_the_sdk_refuses_that_candidate_without_its_message(
        stand_in: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    # The verifier is meant to end every parse in an AttestationError; the SDK must not rely on it.
    # Only a verifier that raises something else, carrying the bytes it choked on, shows that.
    import client.verify

    canary = "CANARY-93b1-EVIDENCE-BYTES"

    def choking(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"unexpected bytes {canary}")

    monkeypatch.setattr(client.verify, "verify", choking)
    entry = _entry(stand_in.directory["nodes"][0])
    verifier = client.verify.CandidateVerifier(shipped_policy("dev"))
    for record in (verifier.check(entry), verifier.check_fresh(entry, entry.evidence, secrets.token_bytes(32))):
        assert not record.ok and record.failed_check == "format"
        assert "RuntimeError" in record.failure and canary not in record.failure
