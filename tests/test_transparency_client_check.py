"""The client's offline check of a node's stapled proofs, under a policy of one log, two witnesses and a
quorum of two: each way a node can fail it is refused with its own error, before anything is sent."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from attestation.transparency.checkpoint import Checkpoint
from attestation.transparency.client_check import (
    CheckpointMemory,
    NodeIdentity,
    ProofBundle,
    StapledEntry,
    TransparencyRequirement,
    check_node,
    parse_bundle,
)
from attestation.transparency.cosignature import generate_cosigner
from attestation.transparency.errors import (
    CheckpointAgeError,
    ForkError,
    NoteSignatureError,
    NotLoggedError,
    TransparencyError,
    WitnessQuorumError,
    WrongEntryError,
)
from attestation.transparency.note import generate_signer
from attestation.transparency.policy import parse_policy
from attestation.transparency.proof import TlogProof, parse_proof
from attestation.transparency.statements import NodeKeyStatement, ReleaseStatement, encode_statement
from transparency.reader import LogReader
from transparency.staple import proof_bundle, stapled_entry
from transparency.witness import Witness
from tests.transparency_support import witnessed_log

NOW = 1_800_000_000
LOG = generate_signer("log.example/veil")
WITNESSES = [generate_cosigner("w1.example"), generate_cosigner("w2.example")]
KEY_CONFIG = b"\x01\x00\x20the node's OHTTP key configuration"


def _hex(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


NODE = NodeIdentity(_hex("code"), _hex("policy"), _hex("model"), _hex("measurement"), KEY_CONFIG, bytes([0xAB] * 32))
RELEASE = ReleaseStatement("1.0", NODE.code_digest, NODE.policy_digest, (NODE.model_digest,))
OTHER_RELEASE = ReleaseStatement("0.9", _hex("old code"), NODE.policy_digest, (NODE.model_digest,))
NODE_KEY = NodeKeyStatement(hashlib.sha256(KEY_CONFIG).hexdigest(), NODE.measurement, NOW - 100, NOW + 3600,
                            "ab" * 32)
REQUIREMENT = TransparencyRequirement(parse_policy(
    f"log {LOG.verifier.encode()}\n"
    + "".join(f"witness w{i + 1} {w.verifier.encode()}\n" for i, w in enumerate(WITNESSES))
    + "group both all w1 w2\nquorum both\n"), max_age_s=3600)


def _build(directory: Path, entries: list[bytes], witnesses: list[Witness]) -> LogReader:
    return witnessed_log(directory, LOG, entries, witnesses)


def _witnesses(state: Path, clock: float = NOW) -> list[Witness]:
    return [Witness(w, [LOG.verifier], state / f"{w.name}.json", clock=lambda: clock) for w in WITNESSES]


ENTRIES = [encode_statement(OTHER_RELEASE), encode_statement(RELEASE), b"someone else's entry",
           encode_statement(NODE_KEY)]


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> LogReader:
    root = tmp_path_factory.mktemp("client")
    return _build(root / "log", ENTRIES, _witnesses(root))


def test_a_logged_and_witnessed_node_passes(reader: LogReader) -> None:
    bundle = parse_bundle(proof_bundle(reader, 1, 3).to_json())
    logged = check_node(bundle, NODE, REQUIREMENT, NOW)
    assert logged.release == RELEASE and logged.node_key == NODE_KEY and logged.checkpoint_sizes == (4, 4)


def test_a_release_or_key_not_logged_is_refused(reader: LogReader) -> None:
    good = proof_bundle(reader, 1, 3)
    for bundle in (None, replace(good, release=None)):
        with pytest.raises(NotLoggedError, match="release is not logged"):
            check_node(bundle, NODE, REQUIREMENT, NOW)
    with pytest.raises(NotLoggedError, match="key is not logged"):
        check_node(replace(good, node_key=None), NODE, REQUIREMENT, NOW)
    with pytest.raises(NotLoggedError, match="validity"):
        check_node(good, NODE, replace(REQUIREMENT, max_age_s=86400), NOW + 7200)  # the key expired at NOW + 3600
    with pytest.raises(WrongEntryError):  # a key configuration the log never saw
        check_node(good, replace(NODE, key_config=b"another key"), REQUIREMENT, NOW)
    with pytest.raises(WrongEntryError, match="receipt key"):  # receipts under a key the log never saw
        check_node(good, replace(NODE, receipt_key=bytes(32)), REQUIREMENT, NOW)


def test_a_proof_for_another_entry_is_refused(reader: LogReader) -> None:
    good = proof_bundle(reader, 1, 3)
    other = stapled_entry(reader, 0)  # a real, logged release, but not this node's
    swapped = StapledEntry(good.release.entry, other.proof)  # this node's release with another entry's proof
    for bundle in (replace(good, release=other), replace(good, release=swapped),
                   replace(good, node_key=stapled_entry(reader, 2))):
        with pytest.raises(WrongEntryError):
            check_node(bundle, NODE, REQUIREMENT, NOW)


def test_a_checkpoint_short_of_the_quorum_is_refused(tmp_path: Path) -> None:
    one_witness = _build(tmp_path / "log", ENTRIES, _witnesses(tmp_path)[:1])
    with pytest.raises(WitnessQuorumError):
        check_node(proof_bundle(one_witness, 1, 3), NODE, REQUIREMENT, NOW)
    unwitnessed = _build(tmp_path / "bare", ENTRIES, [])
    with pytest.raises(WitnessQuorumError):
        check_node(proof_bundle(unwitnessed, 1, 3), NODE, REQUIREMENT, NOW)


def test_a_checkpoint_older_than_the_policy_allows_is_refused(reader: LogReader) -> None:
    bundle = proof_bundle(reader, 1, 3)
    with pytest.raises(CheckpointAgeError, match="older"):
        check_node(bundle, NODE, replace(REQUIREMENT, max_age_s=60), NOW + 61)
    with pytest.raises(CheckpointAgeError, match="future"):
        check_node(bundle, NODE, REQUIREMENT, NOW - 3600)


def test_a_policy_without_a_witness_quorum_accepts_no_proof(tmp_path: Path) -> None:
    """The log's signature alone says nothing of a checkpoint's age (only cosignatures carry a time), nor that
    others see the same tree: under `quorum none`, a proof no witness saw would pass at any age."""
    log_alone = TransparencyRequirement(parse_policy(f"log {LOG.verifier.encode()}\nquorum none\n"), max_age_s=60)
    unwitnessed = proof_bundle(_build(tmp_path / "log", ENTRIES, []), 1, 3)
    for now in (NOW, NOW + 3000):
        with pytest.raises(WitnessQuorumError, match="no witness quorum"):
            check_node(unwitnessed, NODE, log_alone, now)


def test_a_forked_log_is_refused(reader: LogReader, tmp_path: Path) -> None:
    """Witnesses that would cosign anything (fresh state) show a second tree of size 4: the client,
    holding both views, refuses it, within one bundle and across nodes."""
    forked = _build(tmp_path / "fork", [ENTRIES[0], ENTRIES[1], b"another entry", ENTRIES[3]],
                    _witnesses(tmp_path))  # fresh state files: they never saw the first log
    mixed = ProofBundle(stapled_entry(reader, 1), stapled_entry(forked, 3))
    with pytest.raises(ForkError):
        check_node(mixed, NODE, REQUIREMENT, NOW)
    memory = CheckpointMemory()
    check_node(proof_bundle(reader, 1, 3), NODE, REQUIREMENT, NOW, memory)
    with pytest.raises(ForkError):
        check_node(proof_bundle(forked, 1, 3), NODE, REQUIREMENT, NOW, memory)
    with pytest.raises(ForkError, match="log.example/veil is forked"):  # the view seen first is no better
        check_node(proof_bundle(reader, 1, 3), NODE, REQUIREMENT, NOW, memory)


def test_the_checkpoint_memory_is_bounded_and_forgets_the_oldest_first() -> None:
    memory = CheckpointMemory(limit=3)
    for size in range(1, 6):
        memory.remember(Checkpoint("log.example/veil", size, hashlib.sha256(b"%d" % size).digest()))
    assert sorted(size for _, size in memory.roots) == [3, 4, 5]
    with pytest.raises(ForkError):
        memory.remember(Checkpoint("log.example/veil", 5, hashlib.sha256(b"another tree").digest()))
    assert len(memory.roots) == 3


def test_a_checkpoint_of_another_log_key_and_malformed_proofs_are_refused(reader: LogReader, tmp_path: Path) -> None:
    good = proof_bundle(reader, 1, 3)
    proof = parse_proof(good.release.proof)
    assert parse_proof(proof.encode()) == proof
    another_key = generate_signer("log.example/veil").verifier
    impostor = replace(REQUIREMENT, policy=replace(REQUIREMENT.policy, log=another_key))
    with pytest.raises(NoteSignatureError):
        check_node(good, NODE, impostor, NOW)
    for bad in (b"", b"c2sp.org/tlog-proof@v1\nindex 01\n\n" + proof.checkpoint,
                b"c2sp.org/tlog-proof@v1\nindex 1\nAAAA\n\n" + proof.checkpoint,
                TlogProof(1, proof.hashes, b"not a note").encode()):
        with pytest.raises(TransparencyError):
            check_node(replace(good, release=StapledEntry(good.release.entry, bad)), NODE, REQUIREMENT, NOW)
    for data in (b"[]", b'{"release": {"entry": "!!"}}', b"\xff", b'{"release": 1}'):
        with pytest.raises(TransparencyError):
            parse_bundle(data)
