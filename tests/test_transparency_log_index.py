"""The log server's index of its own log (`transparency.log_index`), held to what reading every entry
back says: each entry's newest index and each release's, caught up as the log grows past bundle edges,
whoever appends."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from attestation.transparency.statements import ReleaseStatement, decode_statement, encode_statement
from transparency.fetch import directory_fetch
from transparency.log import append_entries, init_log
from transparency.log_index import LogIndex
from transparency.reader import LogReader
from transparency.writer import LogWriter
from tests.test_transparency_log import NODE_KEY, RELEASE, SIGNER, UNTRUSTED, _digest, issuer_key


def _reader(root: Path) -> LogReader:
    return LogReader(directory_fetch(root), SIGNER.verifier)


def _newest_by_reading_back(reader: LogReader, code: str, policy: str, model: str) -> int | None:
    """The release lookup as the writer did it before the index: every entry, newest first."""
    for index in range(reader.size - 1, -1, -1):
        statement = decode_statement(reader.entry(index))
        if isinstance(statement, ReleaseStatement) and (statement.code_digest, statement.policy_digest) == (
                code, policy) and model in statement.model_digests:
            return index
    return None


def test_the_index_catches_up_across_bundle_edges_and_agrees_with_reading_every_entry(tmp_path: Path) -> None:
    init_log(tmp_path, SIGNER)
    index = LogIndex()
    index.catch_up(_reader(tmp_path))
    assert index.size == 0 and index.index_of(encode_statement(NODE_KEY)) is None
    newer = dataclasses.replace(RELEASE, version="1.0.2", model_digests=(_digest("model"), _digest("model 2")))
    batches = [
        [encode_statement(RELEASE), encode_statement(NODE_KEY)],
        [issuer_key(i) for i in range(250)],  # the first bundle fills past 256 during the next batch
        [encode_statement(UNTRUSTED)] + [issuer_key(i) for i in range(250, 300)] + [encode_statement(newer)],
        [encode_statement(NODE_KEY)],  # the same entry again: its newest index counts
    ]
    for batch in batches:
        append_entries(tmp_path, SIGNER, batch)
        reader = _reader(tmp_path)
        index.catch_up(reader)
        assert index.size == reader.size
        for code, model in ((RELEASE.code_digest, _digest("model")), (RELEASE.code_digest, _digest("model 2")),
                            (UNTRUSTED.code_digest, _digest("model")), (RELEASE.code_digest, _digest("other"))):
            assert index.release_index(code, RELEASE.policy_digest, model) == \
                _newest_by_reading_back(reader, code, RELEASE.policy_digest, model)
    reader = _reader(tmp_path)
    assert index.index_of(encode_statement(NODE_KEY)) == reader.size - 1
    assert index.index_of(issuer_key(299)) == 2 + 250 + 1 + 49
    assert reader.entry(index.index_of(issuer_key(7))) == issuer_key(7)  # type: ignore[arg-type]
    # A fresh index reads the whole log once and agrees.
    fresh = LogIndex()
    fresh.catch_up(reader)
    assert (fresh.entries, fresh.releases) == (index.entries, index.releases)


def test_another_smaller_log_is_read_from_its_start(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    for root in (first, second):
        init_log(root, SIGNER)
    append_entries(first, SIGNER, [issuer_key(i) for i in range(5)] + [encode_statement(RELEASE)])
    append_entries(second, SIGNER, [encode_statement(UNTRUSTED)])
    index = LogIndex()
    index.catch_up(_reader(first))
    index.catch_up(_reader(second))
    assert index.size == 1 and index.index_of(issuer_key(0)) is None
    assert index.release_index(RELEASE.code_digest, RELEASE.policy_digest, _digest("model")) is None
    assert index.release_index(UNTRUSTED.code_digest, UNTRUSTED.policy_digest, _digest("model")) == 0


def test_the_writer_finds_releases_appended_beside_it(tmp_path: Path) -> None:
    init_log(tmp_path, SIGNER)
    writer = LogWriter(tmp_path, SIGNER, policy=None)  # type: ignore[arg-type]  # no append is checked here
    lookup = (RELEASE.code_digest, RELEASE.policy_digest, _digest("model"))
    assert writer.release_index(*lookup) is None
    append_entries(tmp_path, SIGNER, [issuer_key(1), encode_statement(RELEASE)])  # `veil log append`, beside it
    assert writer.release_index(*lookup) == 1
