"""The C2SP formats Veil builds on, past the published vectors: cosignatures, checkpoints, tiles,
policies, statements, proofs built from tiles that the vector-tested verifiers accept, and every
parser fed arbitrary bytes."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attestation.transparency.checkpoint import Checkpoint, open_checkpoint, parse_checkpoint
from attestation.transparency.client_check import parse_bundle as parse_proof_bundle
from attestation.transparency.cosignature import CosignatureVerifier, generate_cosigner
from attestation.transparency.errors import (
    CheckpointFormatError,
    ConsistencyProofError,
    InclusionProofError,
    NoteSignatureError,
    PolicyFormatError,
    StatementFormatError,
    TileError,
    TransparencyError,
)
from attestation.transparency.merkle import (
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root_of,
    subtree_hash,
    verify_consistency,
    verify_inclusion,
)
from attestation.transparency.encoded_keys import parse_signer, parse_verifier
from attestation.transparency.note import generate_signer, parse_note, sign_note
from attestation.transparency.policy import parse_policy
from attestation.transparency.proof import parse_proof
from attestation.transparency.statements import (
    IssuerKeyStatement,
    LaunchMeasurement,
    NodeKeyStatement,
    ReleaseStatement,
    decode_statement,
    encode_statement,
)
from attestation.transparency.tiles import (
    TileHashes,
    TileName,
    decode_index,
    encode_bundle,
    encode_index,
    parse_bundle,
    parse_tile,
    parse_tile_path,
    tile_count,
    tiles_for,
)
from transparency.protocol import parse_add_checkpoint

ROOT = hashlib.sha256(b"root").digest()


# ----- cosignature/v1 ----------------------------------------------------------------------------------


def test_a_cosignature_verifies_with_its_time_and_fails_with_another() -> None:
    log, witness = generate_signer("example.com/log"), generate_cosigner("witness.example")
    text = Checkpoint("example.com/log", 5, ROOT).body()
    note = parse_note(sign_note(text, log))
    cosigned = parse_note(note.encode() + witness.cosign(text, 1_700_000_000).encode())
    verifier = parse_verifier(witness.verifier.encode())
    assert isinstance(verifier, CosignatureVerifier) and verifier.key_type == 0x04
    assert verifier.timestamp(cosigned) == 1_700_000_000
    assert verifier.timestamp(note) is None
    # The time is signed: moving it by one second breaks the signature.
    moved = witness.cosign(text, 1_700_000_000)
    forged = type(moved)(moved.name, moved.key_id, (1_700_000_001).to_bytes(8, "big") + moved.signature[8:])
    with pytest.raises(NoteSignatureError):
        verifier.timestamp(parse_note(note.encode() + forged.encode()))


def test_a_cosigner_key_hash_uses_type_4_and_its_private_key_round_trips() -> None:
    witness = generate_cosigner("w1")
    public = witness.public
    assert witness.verifier.key_id == hashlib.sha256(b"w1\n\x04" + public).digest()[:4]
    again = parse_signer(witness.encode())
    assert again.verifier == witness.verifier and "w1" in repr(again) and witness.encode() not in repr(again)


# ----- checkpoints ----------------------------------------------------------------------------------------


def test_a_checkpoint_round_trips_with_extensions_and_is_bound_to_its_origin() -> None:
    log = generate_signer("example.com/log")
    checkpoint = Checkpoint("example.com/log", 12, ROOT, ("ext one",))
    assert parse_checkpoint(checkpoint.body()) == checkpoint
    opened = open_checkpoint(sign_note(checkpoint.body(), log).encode(), log.verifier)
    assert opened.checkpoint == checkpoint
    other = Checkpoint("example.com/other", 12, ROOT)
    with pytest.raises(CheckpointFormatError):
        open_checkpoint(sign_note(other.body(), log), log.verifier)


@pytest.mark.parametrize("body", [
    "origin\n12\n", "origin\n012\n" + "A" * 43 + "=\n", "origin\n-1\nAAAA\n", "origin\n1\nAAAA\n",
    "\n1\n" + "A" * 43 + "=\n", "origin\n1\n" + "A" * 43 + "=\n\n", "origin\n1\n" + "A" * 43 + "=",
    "origin\n99999999999999999999\n" + "A" * 43 + "=\n", "origin\n١\n" + "A" * 43 + "=\n",
])
def test_malformed_checkpoints_are_refused(body: str) -> None:
    with pytest.raises(CheckpointFormatError):
        parse_checkpoint(body)


# ----- tiles ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("index", "encoded"), [(0, "000"), (5, "005"), (999, "999"), (1000, "x001/000"),
                                                (1234067, "x001/x234/067")])
def test_tile_index_path_elements(index: int, encoded: str) -> None:
    assert encode_index(index) == encoded and decode_index(encoded) == index


def test_tile_paths_full_partial_and_entries() -> None:
    assert TileName(0, 1234067).path() == "tile/0/x001/x234/067"
    assert TileName(1, 5, 8).path() == "tile/1/005.p/8"
    assert TileName(None, 1000, 3).path() == "tile/entries/x001/000.p/3"
    for name in (TileName(0, 1234067), TileName(1, 5, 8), TileName(None, 1000, 3)):
        assert parse_tile_path(name.path()) == name
    assert list(tiles_for(70000, 0))[-1] == TileName(0, 273, 112) and tile_count(70000, 0) == 274
    assert list(tiles_for(70000, 1)) == [TileName(1, 0), TileName(1, 1, 17)]  # 70000 >> 8 = 273 hashes
    assert list(tiles_for(70000, 2)) == [TileName(2, 0, 1)] and list(tiles_for(70000, 3)) == []
    assert [tile_count(size, None) for size in (0, 1, 256, 257)] == [0, 1, 1, 2]
    # Lazy: a checkpoint signed over 2**40 leaves names its first tile at once and its last by arithmetic.
    assert next(tiles_for(2**40, None)) == TileName(None, 0) and tile_count(2**40, None) == 2**32


@pytest.mark.parametrize("path", ["tile/0/x001", "tile/0/0005", "tile/0/x000/005", "tile/0/005.p/256",
                                  "tile/0/005.p/0", "tile/01/005", "tile/64/005", "tiles/0/005", "tile/0/05"])
def test_malformed_tile_paths_are_refused(path: str) -> None:
    with pytest.raises(TileError):
        parse_tile_path(path)


def test_bundles_and_tiles_parse_exactly() -> None:
    entries = [b"", b"a", b"x" * 300]
    assert parse_bundle(encode_bundle(entries), 3) == entries
    for bad, width in ((encode_bundle(entries)[:-1], 3), (encode_bundle(entries), 2), (b"\x00", 1)):
        with pytest.raises(TileError):
            parse_bundle(bad, width)
    with pytest.raises(TileError):
        parse_tile(b"\x00" * 33, 1)


def _tiles_of(leaves: list[bytes]) -> dict[str, bytes]:
    """Tiles built directly from the definition: level L holds the complete subtrees of height 8L."""
    files, level, number = {}, leaves, 0
    while level:
        for name in tiles_for(len(leaves), number):
            files[name.path()] = b"".join(level[name.index * 256:name.index * 256 + name.width])
        level = [root_of(level[i:i + 256]) for i in range(0, len(level) - len(level) % 256, 256)]
        number += 1
    return files


@pytest.mark.parametrize("size", [1, 2, 7, 256, 257, 600])
def test_proofs_from_tiles_verify_and_match_the_tree(size: int) -> None:
    leaves = [leaf_hash(str(i).encode()) for i in range(size)]
    tree = TileHashes(_tiles_of(leaves).get, size)
    root = root_of(leaves)
    assert subtree_hash(tree.complete, 0, size) == root
    for index in {0, size // 2, size - 1}:
        verify_inclusion(leaves[index], index, size, inclusion_proof(tree.complete, index, size), root)
    for old in {1, size // 3 or 1, size - 1 or 1, size}:
        proof = consistency_proof(tree.complete, old, size)
        verify_consistency(old, size, proof, root_of(leaves[:old]), root)
    with pytest.raises(InclusionProofError):
        verify_inclusion(leaf_hash(b"other"), 0, size, inclusion_proof(tree.complete, 0, size), root)
    if size > 2:
        with pytest.raises(ConsistencyProofError):
            verify_consistency(2, size, consistency_proof(tree.complete, 2, size), root_of(leaves[:1] * 2), root)


def test_a_missing_partial_tile_is_read_from_its_full_tile() -> None:
    leaves = [leaf_hash(str(i).encode()) for i in range(600)]
    files = _tiles_of(leaves)
    files["tile/1/000.p/1"] = files["tile/1/000.p/2"][:32]  # kept from when the log had 260 entries
    older = TileHashes(files.get, 260)  # tile/0/001.p/4 is gone: its full tile's prefix serves
    assert subtree_hash(older.complete, 0, 260) == root_of(leaves[:260])
    with pytest.raises(TileError):
        TileHashes({}.get, 3).complete(0, 0)


# ----- policy -----------------------------------------------------------------------------------------------


def _policy_text(quorum: str = "both") -> tuple[str, list]:
    log = generate_signer("example.com/log")
    witnesses = [generate_cosigner(f"w{i}") for i in range(3)]
    lines = [f"log {log.verifier.encode()} https://log.example", *(
        f"witness w{i} {w.verifier.encode()}" for i, w in enumerate(witnesses)),
        "group both 2 w0 w1 w2  # any two of three", f"quorum {quorum}"]
    return "\n".join(lines) + "\n", witnesses


def test_a_policy_quorum_counts_witnesses_in_groups() -> None:
    policy = parse_policy(_policy_text()[0])
    assert policy.log.name == "example.com/log" and policy.log_url == "https://log.example"
    assert not policy.satisfied_by({"w0"}) and policy.satisfied_by({"w0", "w2"})
    assert parse_policy(_policy_text("none")[0]).satisfied_by(set())


@pytest.mark.parametrize("mutate", [
    lambda text: text.replace("group both 2", "group both 4"),
    lambda text: text.replace("group both 2 w0", "group both 2 w9"),
    lambda text: text.replace("quorum both", "quorum nobody"),
    lambda text: text.replace("quorum both\n", ""),
    lambda text: text.split("\n", 1)[1],
    lambda text: text.replace("witness w1", "witness w0"),
    lambda text: text + "quorum w0\n",
    lambda text: text + "frobnicate\n",
    lambda text: text.replace("log ", "log x", 1),
])
def test_malformed_policies_name_the_line(mutate) -> None:
    with pytest.raises(PolicyFormatError):
        parse_policy(mutate(_policy_text()[0]))


def test_a_log_key_is_not_accepted_as_a_witness_key() -> None:
    log = generate_signer("l")
    with pytest.raises(PolicyFormatError, match="line 2"):
        parse_policy(f"log {log.verifier.encode()}\nwitness w {log.verifier.encode()}\nquorum none\n")


# ----- statements -------------------------------------------------------------------------------------------


def _digest(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


STATEMENTS = [
    ReleaseStatement("1.2.0", _digest("code"), _digest("policy"), tuple(sorted([_digest("m1"), _digest("m2")])),
                     (LaunchMeasurement("sev-snp", "ab" * 48), LaunchMeasurement("tdx", "cd" * 48, ("00" * 48,) * 4))),
    NodeKeyStatement(_digest("key config"), _digest("measurement"), 100, 200, _digest("receipt key")),
    IssuerKeyStatement(_digest("token key"), 100, 200),
]


@pytest.mark.parametrize("statement", STATEMENTS, ids=lambda s: type(s).__name__)
def test_statements_have_one_canonical_encoding(statement) -> None:
    entry = encode_statement(statement)
    assert decode_statement(entry) == statement
    assert b" " not in entry and entry.startswith(b'{"')
    with pytest.raises(StatementFormatError):
        decode_statement(entry.replace(b",", b", ", 1))  # the same JSON, another encoding


@pytest.mark.parametrize("entry", [
    b"\xff", b"[]", b'{"type":"veil.release/v1"}', b'{"type":"other"}', b'{"a":1,"a":1}', b"[" * 100000,
    b'{"key_config_digest":"00","measurement":"00","not_after":2,"not_before":1,"type":"veil.node-key/v1"}',
    # a node key logged without the receipt key that lets a third party check its receipts
    b'{"key_config_digest":"' + b"0" * 64 + b'","measurement":"' + b"0" * 64
    + b'","not_after":2,"not_before":1,"type":"veil.node-key/v1"}',
    b'{"launch_measurements":[{"x":1}],"model_digests":[],"type":"veil.release/v1"}',
])
def test_malformed_entries_are_statement_errors(entry: bytes) -> None:
    with pytest.raises(StatementFormatError):
        decode_statement(entry)


def test_statements_out_of_shape_are_refused_at_encoding() -> None:
    bad = [
        ReleaseStatement("1 0", _digest("c"), _digest("p"), ()),
        ReleaseStatement("1", _digest("c"), _digest("p"), tuple(sorted([_digest("a"), _digest("b")], reverse=True))),
        ReleaseStatement("1", _digest("c"), _digest("p"), (),
                         (LaunchMeasurement("sev-snp", "ab" * 48, ("00" * 48,) * 4),)),
        NodeKeyStatement(_digest("k"), _digest("m"), 200, 100, _digest("r")),
        NodeKeyStatement(_digest("k"), _digest("m"), 100, 200, _digest("r").upper()),  # one encoding: lowercase
        NodeKeyStatement(_digest("k"), _digest("m"), 100, 200, _digest("r")[:62]),  # not 32 bytes
        NodeKeyStatement(_digest("k"), _digest("m"), 100, 200, None),  # type: ignore[arg-type]
        IssuerKeyStatement("AB" * 32, 1, 2),
    ]
    for statement in bad:
        with pytest.raises(StatementFormatError):
            encode_statement(statement)


# ----- arbitrary input ---------------------------------------------------------------------------------------

_LOG = generate_signer("log.example")
_PARSERS = {
    "note": lambda data: parse_note(data),
    "checkpoint": lambda data: open_checkpoint(data, _LOG.verifier),
    "checkpoint body": lambda data: parse_checkpoint(data.decode("utf-8", "replace")),
    "tile path": lambda data: parse_tile_path(data.decode("utf-8", "replace")),
    "bundle": lambda data: parse_bundle(data, 3),
    "statement": decode_statement,
    "policy": lambda data: parse_policy(data.decode("utf-8", "replace")),
    "verifier key": lambda data: parse_verifier(data.decode("utf-8", "replace")),
    "signer key": lambda data: parse_signer(data.decode("utf-8", "replace")),
    "tlog-proof": parse_proof,
    "proof bundle": parse_proof_bundle,
    "add-checkpoint": parse_add_checkpoint,
}
# Bytes near the formats (their keywords, separators and a valid note) find deeper paths than noise alone.
_PIECES = st.sampled_from([b"\n", b"\n\n", b" ", b"+", b"\xe2\x80\x94 ", b"old 1", b"index 0", b"tile/0/",
                           b".p/", b"x001/", b"{", b"}", b'"type":', b"log ", b"witness ", b"quorum ",
                           b"c2sp.org/tlog-proof@v1", sign_note("log.example\n1\n" + "A" * 43 + "=\n", _LOG).encode(),
                           b"AAAA", b"\xff", b"0"])
_INPUT = st.one_of(st.binary(max_size=300), st.lists(_PIECES, max_size=12).map(b"".join))


@pytest.mark.parametrize("parser", _PARSERS.values(), ids=_PARSERS.keys())
@settings(max_examples=150, deadline=None)
@given(data=_INPUT)
def test_any_bytes_parse_or_end_in_a_transparency_error(parser, data: bytes) -> None:
    try:
        parser(data)
    except TransparencyError:
        pass
