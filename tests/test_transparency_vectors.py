"""Every transparency vector of ../shared/vectors/transparency, positives and negatives.

transparency-dev/merkle's 196 inclusion and consistency files (each `wantErr` is honoured both
ways), and the signed-note vectors of golang.org/x/mod and C2SP.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from attestation.errors import AttestationError
from attestation.transparency.checkpoint import parse_checkpoint
from attestation.transparency.errors import (
    ConsistencyProofError,
    InclusionProofError,
    NoteFormatError,
    NoteSignatureError,
)
from attestation.transparency.merkle import leaf_hash, verify_consistency, verify_inclusion
from attestation.transparency.encoded_keys import parse_signer, parse_verifier
from attestation.transparency.note import open_note, sign_note
from tests.conftest import vectors_path

MERKLE = vectors_path() / "transparency" / "merkle"
NOTES = json.loads((vectors_path() / "transparency" / "signed-note.json").read_text())


def _files(kind: str) -> list[Path]:
    return sorted(path for path in (MERKLE / kind).rglob("*.json"))


def _id(path: Path) -> str:
    return str(path.relative_to(MERKLE))


def _b64(value: str) -> bytes:
    return base64.b64decode(value)


def test_the_suite_is_whole() -> None:
    assert len(_files("inclusion")) + len(_files("consistency")) == 196


@pytest.mark.parametrize("path", _files("inclusion"), ids=_id)
def test_inclusion_vector(path: Path) -> None:
    case = json.loads(path.read_text())
    proof = [_b64(item) for item in case["proof"] or []]
    verify = lambda: verify_inclusion(_b64(case["leafHash"]), case["leafIdx"], case["treeSize"], proof,  # noqa: E731
                                      _b64(case["root"]))
    if case["wantErr"]:
        with pytest.raises(InclusionProofError):
            verify()
    else:
        verify()


@pytest.mark.parametrize("path", _files("consistency"), ids=_id)
def test_consistency_vector(path: Path) -> None:
    case = json.loads(path.read_text())
    proof = [_b64(item) for item in case["proof"] or []]
    verify = lambda: verify_consistency(case["size1"], case["size2"], proof, _b64(case["root1"]),  # noqa: E731
                                        _b64(case["root2"]))
    if case["wantErr"]:
        with pytest.raises(ConsistencyProofError):
            verify()
    else:
        verify()


@pytest.mark.parametrize("case", NOTES["notes"], ids=lambda case: case["name"])
def test_signed_note_vector_verifies(case: dict) -> None:
    verifier = parse_verifier(case["vkey"])
    assert verifier.name == case["vkey"].split("+")[0] and verifier.encode() == case["vkey"]
    note, signed = open_note(case["signed_note"].encode(), (verifier,))
    assert note.text == case["text"] and signed == (verifier,)


@pytest.mark.parametrize("case", NOTES["notes"], ids=lambda case: case["name"])
def test_a_changed_character_fails_the_signature(case: dict) -> None:
    verifier = parse_verifier(case["vkey"])
    changed = case["signed_note"].replace("a", "b", 1)
    with pytest.raises(NoteSignatureError):
        open_note(changed, (verifier,))


def test_the_private_key_signs_the_published_note() -> None:
    [case] = [case for case in NOTES["notes"] if "skey" in case]
    signer = parse_signer(case["skey"])
    assert signer.encode() == case["skey"] and signer.verifier.encode() == case["vkey"]
    assert sign_note(case["text"], signer) == case["signed_note"]  # Ed25519 is deterministic
    assert "AYEKF" not in repr(signer)


def test_an_unknown_key_alone_does_not_open_a_note() -> None:
    enoch = parse_verifier(NOTES["other_verifier_keys"]["EnochRoot"])
    with pytest.raises(NoteSignatureError):
        open_note(NOTES["notes"][0]["signed_note"], (enoch,))
    # A note signed by a known and an unknown key opens with the known one only.
    note, signed = open_note(NOTES["notes"][0]["signed_note"], (enoch, parse_verifier(NOTES["notes"][0]["vkey"])))
    assert [verifier.name for verifier in signed] == ["PeterNeumann"]


@pytest.mark.parametrize("key", [
    "PeterNeumann+c74f20a4+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # hash off by one
    "PeterNeumann+c74f20a3+ApCc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # unknown key type
    "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10",  # short key
    "PeterNeumann+c74f20a3",
    "Peter Neumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
    "PeterNeumann+zz4f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
    "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10T!",
])
def test_malformed_verifier_keys_are_refused_without_echo(key: str) -> None:
    with pytest.raises(NoteFormatError) as raised:
        parse_verifier(key)
    assert "ARpc2Q" not in str(raised.value) and "c74f20" not in str(raised.value)


@pytest.mark.parametrize("note", [
    b"no blank line\n\xe2\x80\x94 PeterNeumann AAAA\n",
    b"text\n\nnot a signature line\n",
    b"text\n\n\xe2\x80\x94 PeterNeumann !!!!\n",
    b"text\n\n\xe2\x80\x94 PeterNeumann AAAA\n",  # shorter than a key hash
    b"text\n\n\xe2\x80\x94 PeterNeumann AAAAAAAA",  # no final newline
    b"\xff\xfe\n\n\xe2\x80\x94 PeterNeumann AAAAAAAA\n",
    b"te\x07xt\n\n\xe2\x80\x94 PeterNeumann AAAAAAAA\n",
])
def test_malformed_notes_end_in_the_projects_error(note: bytes) -> None:
    with pytest.raises(NoteFormatError):
        open_note(note, (parse_verifier(NOTES["notes"][0]["vkey"]),))


def test_the_tree_note_body_is_a_checkpoint_of_the_leaf_hash() -> None:
    tree = NOTES["tree_note"]
    checkpoint = parse_checkpoint(tree["body"])
    assert checkpoint.origin == "go.sum database tree" and checkpoint.size == tree["size"]
    assert checkpoint.root == leaf_hash(tree["record"].encode())
    assert checkpoint.body() == tree["body"]


def test_every_refusal_is_an_attestation_error() -> None:
    assert issubclass(NoteFormatError, AttestationError) and issubclass(InclusionProofError, AttestationError)
