"""Stapled transparency proofs end to end, through a real fleet: a log (`veil log serve --key`), two
witnesses (`veil witness`) and a node that logs its key and staples its proofs, under a policy
requiring a quorum of both witnesses.

The SDK reads each node's proofs from the gateway's directory, unsigned: a dishonest gateway (or a
node) can staple anything. Each refusal below is provoked the way such a party would, by a gateway
that rewrites the proofs in its listing (forwarding everything else to the real one); where the
attack needs the log's or the witnesses' keys (a fork, an old checkpoint), the test holds them as a
colluding operator would. Each is refused with its own error before anything is sent.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from attestation.bundle import EvidenceBundle
from attestation.transparency.checkpoint import Checkpoint, parse_checkpoint
from attestation.transparency.errors import WrongEntryError
from attestation.transparency.cosignature import CosignatureSigner
from attestation.transparency.merkle import leaf_hash
from attestation.transparency.node_append import APPEND_PATH, AppendRequest, append_nonce
from attestation.transparency.note import Note, parse_note, sign_note
from attestation.transparency.proof import TlogProof, parse_proof
from attestation.transparency.statements import NodeKeyStatement, ReleaseStatement, encode_statement
from attestation.verifier import VerifiedNode, verify
from client.directory import parse_directory
from client.errors import NoVerifiedNodeError
from client.sdk import Client
from client.transparency import TransparencyCheck
from client.verify import CandidateVerifier
from transparency.errors import StaleSizeError, WitnessRequestError
from transparency.keys import read_signer
from transparency.protocol import AddCheckpoint, request_cosignature
from policy import load_policy, parse_policy
from policy.errors import InvalidValueError, PlaceholderError
from policy.model import WitnessKey
from protocol.constants import DIRECTORY_PATH, NODE_ATTEST_PATH
from tests.fleet_support import running_fleet
from tests.policy_support import filled_strict, filled_strict_text, write_filled_strict
from veil.demo_transparency import print_transparency
from veil.fleet import Fleet, FleetSettings

MAX_AGE_S = 900
Tamper = Callable[[dict], dict]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    settings = FleetSettings(nodes=1, transparency=True, torch_threads=1, max_checkpoint_age_s=MAX_AGE_S)
    with running_fleet(settings) as running:
        yield running


# ----- a gateway that rewrites the proofs it lists ------------------------------------------------


class RewritingGateway(httpx.BaseTransport):
    """Forwards every request to the real gateway; rewrites each node's proofs in the directory."""

    def __init__(self, tamper: Tamper) -> None:
        self.inner = httpx.HTTPTransport()
        self.tamper = tamper
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        response = self.inner.handle_request(request)
        if request.url.path != DIRECTORY_PATH:
            return response
        response.read()
        directory = json.loads(response.content)
        for node in directory["nodes"]:
            node["transparency"] = json.dumps(self.tamper(json.loads(node["transparency"])))
        return httpx.Response(200, json=directory)


def _refusal(fleet: Fleet, tamper: Tamper) -> tuple[str, str]:
    """The failed check and reason of the one candidate, and that nothing went to /v1/infer."""
    gateway = RewritingGateway(tamper)
    with httpx.Client(base_url=fleet.gateway_url, transport=gateway) as http, \
            Client(fleet.gateway_url, policy=fleet.policy, http=http, max_retries=0) as client:
        model = client.listed_models()[0]
        with pytest.raises(NoVerifiedNodeError) as raised:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert [path for path in gateway.paths if path != DIRECTORY_PATH] == [], "something was sent"
    (failure,) = raised.value.failures
    return failure.check, failure.reason


# ----- rewriting a stapled proof ------------------------------------------------------------------


def _proof(stapled: dict) -> TlogProof:
    return parse_proof(base64.b64decode(stapled["proof"]))


def _with_proof(stapled: dict, proof: TlogProof) -> dict:
    return {**stapled, "proof": base64.b64encode(proof.encode()).decode()}


def _with_note(stapled: dict, note: Note) -> dict:
    return _with_proof(stapled, dataclasses.replace(_proof(stapled), checkpoint=note.encode().encode()))


def _note(stapled: dict) -> Note:
    return parse_note(_proof(stapled).checkpoint)


def _cosigners(fleet: Fleet) -> list[CosignatureSigner]:
    return [read_signer(path) for path in fleet.log_keys.witness_keys]  # type: ignore[misc, union-attr]


def _recosigned(fleet: Fleet, text: str, when: int, log_signed: bool = False) -> Note:
    """`text` signed by the log (if asked) and cosigned by both witnesses at `when`, as colluders could."""
    signatures = parse_note(sign_note(text, read_signer(fleet.log_keys.log_key))).signatures if log_signed else ()
    return Note(text, (*signatures, *(signer.cosign(text, when) for signer in _cosigners(fleet))))


def _without_witness(stapled: dict) -> dict:
    note = _note(stapled)
    log_signature, *cosignatures = note.signatures  # the log signs first; cosignatures follow
    return _with_note(stapled, Note(note.text, (log_signature, *cosignatures[1:])))


def _aged(fleet: Fleet) -> Callable[[dict], dict]:
    def age(stapled: dict) -> dict:
        note = _note(stapled)
        old = _recosigned(fleet, note.text, int(time.time()) - MAX_AGE_S - 120)
        return _with_note(stapled, Note(note.text, (note.signatures[0], *old.signatures)))
    return age


def _forked(fleet: Fleet, stapled: dict) -> dict:
    """The same size under another root, signed by the log and both witnesses' keys."""
    checkpoint = parse_checkpoint(_note(stapled).text)
    other = Checkpoint(checkpoint.origin, checkpoint.size, hashlib.sha256(b"another tree").digest())
    return _with_note(stapled, _recosigned(fleet, other.body(), int(time.time()), log_signed=True))


def test_the_fleets_node_passes_with_its_stapled_proofs(fleet: Fleet) -> None:
    with Client(fleet.gateway_url, policy=fleet.policy, max_retries=0) as client:
        answer = client.chat.completions.create(model=client.listed_models()[0], max_tokens=2,
                                                messages=[{"role": "user", "content": "hi"}])
    assert [record.ok for record in answer.route.candidates] == [True]


def test_the_sdk_refuses_each_transparency_failure_before_sending(fleet: Fleet) -> None:
    cases: dict[str, Tamper] = {
        "release not logged": lambda bundle: {**bundle, "release": None},
        "key not logged": lambda bundle: {**bundle, "node_key": None},
        "proof for another entry": lambda bundle: {**bundle, "release": {**bundle["release"],
                                                                          "entry": bundle["node_key"]["entry"]}},
        "a witness missing": lambda bundle: {name: _without_witness(stapled) for name, stapled in bundle.items()},
        "too old": lambda bundle: {name: _aged(fleet)(stapled) for name, stapled in bundle.items()},
        "forked": lambda bundle: {**bundle, "node_key": _forked(fleet, bundle["node_key"])},
    }
    refusals = {case: _refusal(fleet, tamper) for case, tamper in cases.items()}
    assert {case: check for case, (check, _) in refusals.items()} == {
        "release not logged": "transparency/not-logged", "key not logged": "transparency/not-logged",
        "proof for another entry": "transparency/wrong-entry", "a witness missing": "transparency/witness-quorum",
        "too old": "transparency/checkpoint-age", "forked": "transparency/fork",
    }
    assert "release is not logged" in refusals["release not logged"][1]
    assert "key is not logged" in refusals["key not logged"][1]
    assert len({reason for _, reason in refusals.values()}) == len(cases), "each refusal says its own cause"


# ----- the witnesses and the log's append endpoint, in the fleet ----------------------------------


def _log_signed(fleet: Fleet, checkpoint: Checkpoint) -> bytes:
    return sign_note(checkpoint.body(), read_signer(fleet.log_keys.log_key)).encode()


def _current(fleet: Fleet) -> Checkpoint:
    return parse_checkpoint(parse_note(httpx.get(f"{fleet.log_url}/checkpoint").content).text)


def test_the_fleets_witnesses_refuse_a_rollback_and_a_fork(fleet: Fleet) -> None:
    current = _current(fleet)
    assert current.size >= 2  # the release, then the node's key
    first = json.loads(httpx.get(f"{fleet.log_url}/proof/0").content)["entry"]
    rollback = Checkpoint(current.origin, 1, leaf_hash(base64.b64decode(first)))  # the log as it was: size 1
    fork = Checkpoint(current.origin, current.size, hashlib.sha256(b"another tree").digest())
    with httpx.Client(timeout=30.0) as http:
        for url in fleet.witness_urls:
            with pytest.raises(StaleSizeError) as stale:  # c2sp.org/tlog-witness: 409 with the witness's size
                request_cosignature(http, url, AddCheckpoint(1, (), _log_signed(fleet, rollback)))
            assert stale.value.size == current.size
            for forged, reason in ((rollback, "400: old size"), (fork, "422: the log shows two trees")):
                with pytest.raises(WitnessRequestError) as refused:
                    request_cosignature(http, url, AddCheckpoint(current.size, (), _log_signed(fleet, forged)))
                assert reason in str(refused.value)


def _node_evidence(fleet: Fleet, entry: bytes) -> tuple[str, VerifiedNode]:
    """The node's fresh evidence over the nonce vouching for `entry`, and what it proves."""
    node = parse_directory(httpx.get(f"{fleet.gateway_url}{DIRECTORY_PATH}").json(), 0).entries[0]
    answer = httpx.post(f"{fleet.gateway_url}{NODE_ATTEST_PATH.format(node_id=node.node_id)}",
                        json={"nonce": append_nonce(entry).hex()}, timeout=30.0)
    evidence = answer.json()["evidence"]
    return evidence, verify(EvidenceBundle.from_json(evidence), load_policy(fleet.policy))


def _append(fleet: Fleet, entry: bytes, evidence: str) -> httpx.Response:
    return httpx.post(f"{fleet.log_url}{APPEND_PATH}", content=AppendRequest(entry, evidence).to_json(), timeout=30.0)


def test_the_logs_append_endpoint_takes_only_the_evidences_own_key_statement(fleet: Fleet) -> None:
    now = int(time.time())
    node = _node_evidence(fleet, b"probe")[1]
    measurement = node.measurement
    own = NodeKeyStatement(hashlib.sha256(node.key_config).hexdigest(), measurement.digest().hex(), now, now + 3600,
                           receipt_key=node.receipt_key.hex())
    others = dataclasses.replace(own, key_config_digest=hashlib.sha256(b"a key no node serves").hexdigest())
    stranger = dataclasses.replace(own, measurement=hashlib.sha256(b"other code").hexdigest())
    forger = dataclasses.replace(own, receipt_key="ab" * 32)
    release = ReleaseStatement("9.9", measurement.code_digest.hex(), measurement.policy_digest.hex(),
                               (measurement.model_digest.hex(),))
    size = _current(fleet).size
    for statement, reason in ((others, "key configuration is not the one bound"),
                              (stranger, "measurement is not the evidence's"),
                              (forger, "receipt key is not the one bound"), (release, "only its own key")):
        entry = encode_statement(statement)
        refused = _append(fleet, entry, _node_evidence(fleet, entry)[0])
        assert refused.status_code == 403 and reason in refused.json()["error"]
    replayed = _append(fleet, encode_statement(own), _node_evidence(fleet, b"another nonce")[0])
    assert replayed.status_code == 403 and "does not verify" in replayed.json()["error"]
    assert _current(fleet).size == size, "a refused statement was appended"
    entry = encode_statement(own)
    accepted = _append(fleet, entry, _node_evidence(fleet, entry)[0])
    assert accepted.status_code == 200 and accepted.json()["index"] == size


@pytest.mark.parametrize("body", [b"", b"not json", b'{"entry": 1, "evidence": "x"}', b'{"entry": "!!", "evidence": ""}',
                                  b'{"entry": "e30=", "evidence": "{}"}', b"[" * 5000])
def test_a_malformed_append_is_a_400_naming_what_is_wrong_and_the_log_keeps_serving(fleet: Fleet, body: bytes) -> None:
    size = _current(fleet).size
    refused = httpx.post(f"{fleet.log_url}{APPEND_PATH}", content=body, timeout=30.0)
    assert refused.status_code == 400
    message = refused.json()["error"]
    assert "append request" in message or "not a statement Veil logs" in message
    assert _current(fleet).size == size
    assert httpx.get(f"{fleet.log_url}/proof/0").status_code == 200


def test_the_logs_lookups_refuse_what_it_does_not_hold(fleet: Fleet) -> None:
    assert httpx.get(f"{fleet.log_url}/proof/{10 ** 6}").status_code == 404
    assert httpx.get(f"{fleet.log_url}/proof/-1").status_code == 404
    missing = httpx.get(f"{fleet.log_url}/release-index", params={"code": "0" * 64, "policy": "0" * 64, "model": "0" * 64})
    assert missing.status_code == 404 and "no release statement" in missing.json()["error"]


@pytest.mark.parametrize("arguments,reason", [
    (["--policy", "dev"], "only with --key"), (["--witness", "http://127.0.0.1:9"], "only with --key"),
    (["--key", "KEY"], "--key needs --policy"),
])
def test_veil_log_serve_refuses_writer_options_it_cannot_use(fleet: Fleet, arguments: list[str], reason: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from veil.cli import main

    arguments = [str(fleet.log_keys.log_key) if value == "KEY" else value for value in arguments]  # type: ignore[union-attr]
    assert main(["log", "serve", str(fleet.log_keys.log_directory), *arguments]) == 2  # type: ignore[union-attr]
    assert reason in capsys.readouterr().err


# ----- what the policy says --------------------------------------------------------------------


def test_a_client_under_a_policy_not_requiring_transparency_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="veil.client"):
        Client("http://127.0.0.1:9", policy="dev").close()
    assert any("does not require transparency" in record.getMessage() for record in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="veil.client"):
        Client("http://127.0.0.1:9", policy=filled_strict()).close()
    assert not any("transparency" in record.getMessage() for record in caplog.records)


def test_a_policy_requiring_transparency_without_a_log_admits_no_node(fleet: Fleet) -> None:
    entry = parse_directory(httpx.get(f"{fleet.gateway_url}{DIRECTORY_PATH}").json(), 0).entries[0]
    record = CandidateVerifier(load_policy(fleet.policy)).check(entry)
    assert record.ok
    text = open(fleet.policy, encoding="utf-8").read()
    section = text[text.index("[transparency]"):]
    with pytest.raises(PlaceholderError, match=r"transparency\.log_key"):  # such a file is refused at load
        parse_policy(text.replace(section, "[transparency]\nrequired = true\nlog_key = \"\"\n"
                                          "witnesses = [{ name = \"w1\", key = \"\" }]\n"
                                          "quorum = 1\nmax_checkpoint_age_s = 900\n"))
    # And were one built past the loader, the client's check still admits no node under it.
    loaded = parse_policy(text)
    unnamed = dataclasses.replace(loaded, transparency=dataclasses.replace(
        loaded.transparency, log_key="", witnesses=(WitnessKey("w1", ""),), quorum=1))
    refused = TransparencyCheck(unnamed).check(record, entry.transparency, time.time())
    assert (refused.ok, refused.failed_check) == (False, "transparency/not-logged")
    assert "names no log key" in (refused.failure or "")
    not_required = parse_policy(text.replace("required = true", "required = false"))
    assert TransparencyCheck(not_required).check(record, None, time.time()).ok


def test_only_a_development_policy_may_run_without_transparency() -> None:
    text = filled_strict_text()
    with pytest.raises(InvalidValueError, match="transparency.required = false is a development setting"):
        parse_policy(text.replace("required = true", "required = false"))
    with pytest.raises(InvalidValueError, match="quorum is larger"):
        parse_policy(text.replace("quorum = 2", "quorum = 4"))
    assert parse_policy(text).transparency.required


def test_the_demo_prints_each_nodes_transparency_check(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    print_transparency(fleet.gateway_url, load_policy(fleet.policy))
    lines = capsys.readouterr().out.splitlines()
    assert "quorum 2 of 2 witnesses" in lines[0]
    (node,) = lines[1:]
    assert "logged release 0.1.0" in node and "logged key" in node and "cosigned by witness-a, witness-b" in node


def test_a_nodes_transparency_log_comes_from_its_config_file_too(tmp_path: Path) -> None:
    from enclave.cli import node_settings
    from veil.cli import build_parser
    from veil.config_file import apply_config_file

    config = tmp_path / "node.toml"
    config.write_text('model = "/models/tiny"\ntransparency-log = "http://127.0.0.1:8300"\n'
                      "transparency-refresh-s = 30\n", encoding="utf-8")
    argv = ["node", "--config", str(config)]
    parser = build_parser()
    apply_config_file(parser, argv)
    settings = node_settings(parser.parse_args(argv))
    assert (settings.transparency_log, settings.transparency_refresh_s) == ("http://127.0.0.1:8300", 30.0)
    assert node_settings(build_parser().parse_args(["node", "--model", "/m"])).transparency_log is None


def test_a_rotated_key_is_logged_and_its_proofs_replace_the_old_keys(fleet: Fleet) -> None:
    """The node's stapler against the fleet's real log and witnesses, with simulated evidence of its own."""
    from attestation.backends import get_backend
    from attestation.measurement import measure
    from attestation.receipts import ReceiptSigner
    from attestation.transparency.client_check import NodeIdentity, check_node, parse_bundle
    from attestation.transparency.requirement import transparency_requirement
    from enclave.transparency import TransparencyStapler
    from ohttp.keys import generate_key_pair

    policy = load_policy(fleet.policy)
    measurement = measure(policy_path=fleet.policy, model_dir=fleet.model_dir.resolve())
    backend, receipts = get_backend("sim", policy=policy), ReceiptSigner.generate()
    served = [generate_key_pair(0).config.encode()]
    stapler = TransparencyStapler(fleet.log_url, measurement, lambda: served[0],
                                  lambda nonce: backend.collect(served[0], measurement, nonce,
                                                                receipts.public_key).to_json(),
                                  3600, 60, receipts.public_key)
    requirement = transparency_requirement(policy.transparency)

    def node(key_config: bytes) -> NodeIdentity:
        return NodeIdentity(measurement.code_digest.hex(), measurement.policy_digest.hex(),
                            measurement.model_digest.hex(), measurement.digest().hex(), key_config,
                            receipts.public_key)

    assert stapler.refresh_quietly(), stapler.last_error
    first, first_index = served[0], stapler.logged_index
    check_node(parse_bundle(stapler.proofs), node(first), requirement, time.time())
    served[0] = generate_key_pair(1).config.encode()  # the rotation
    stapler.key_rotated()
    assert stapler.proofs == "" and stapler.logged_index is None  # nothing stapled for a key not yet logged
    assert stapler.refresh_quietly(), stapler.last_error
    assert stapler.logged_index is not None and stapler.logged_index > first_index  # type: ignore[operator]
    check_node(parse_bundle(stapler.proofs), node(served[0]), requirement, time.time())
    with pytest.raises(WrongEntryError, match="not the key configuration this node serves"):
        check_node(parse_bundle(stapler.proofs), node(first), requirement, time.time())


def test_a_fleet_whose_code_changed_under_its_first_measurement_logs_the_current_release(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkout is edited between the fleet's measurement and the nodes' own: the first release
    logged names code nobody runs. The fleet sees its node staple no release, logs the release as
    measured now, and starts only once the directory lists the node's proofs of both."""
    import veil.fleet

    measured = veil.fleet.release_of
    calls: list[ReleaseStatement] = []

    def first_one_stale(policy_path: str, model_dir: Path) -> ReleaseStatement:
        release = measured(policy_path, model_dir)
        stale = dataclasses.replace(release, code_digest=hashlib.sha256(b"before the edit").hexdigest())
        calls.append(release if calls else stale)
        return calls[-1]

    monkeypatch.setattr(veil.fleet, "release_of", first_one_stale)
    with running_fleet(FleetSettings(nodes=1, transparency=True, torch_threads=1)) as edited:
        listed = json.loads(httpx.get(f"{edited.gateway_url}{DIRECTORY_PATH}").json()["nodes"][0]["transparency"])
        with Client(edited.gateway_url, policy=edited.policy, max_retries=0) as client:
            answer = client.chat.completions.create(model=client.listed_models()[0], max_tokens=2,
                                                    messages=[{"role": "user", "content": "hi"}])
    assert len(calls) >= 2 and calls[0].code_digest != calls[1].code_digest
    assert base64.b64decode(listed["release"]["entry"]) == encode_statement(calls[1])
    assert answer.route.candidates[0].ok


def test_veil_chat_under_a_policy_not_requiring_transparency_says_so(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    import socket

    from veil.cli import main

    with socket.socket() as probe:  # a port nobody listens on: the chat fails after its warnings
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    assert main(["chat", "hi", "--gateway", f"http://127.0.0.1:{closed}", "--policy", "dev"]) == 1
    assert "does not require transparency" in capsys.readouterr().err
    strict = str(write_filled_strict(tmp_path / "strict.toml"))
    assert main(["chat", "hi", "--gateway", f"http://127.0.0.1:{closed}", "--policy", strict]) == 1
    assert "transparency" not in capsys.readouterr().err


def test_veil_up_can_run_the_log_and_witnesses() -> None:
    from veil.cli import build_parser

    assert build_parser().parse_args(["up", "--transparency"]).transparency is True
    assert build_parser().parse_args(["up"]).transparency is False
