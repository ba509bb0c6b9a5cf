"""What `veil log serve --key` looks up in its own log, kept as the log grows.

A node's append asks whether its statement is logged already, and every node's proof refresh asks for
the newest release statement listing its digests. Read back entry by entry, each question read the
whole log (a bundle of 256 entries parsed again for every entry), so each grew with the log's size and
ran again every refresh interval for every node. The index reads each entry bundle once: at the first
question, and after that only the bundles of entries appended since, whoever appended them (this
server, or `veil log append` beside it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from attestation.transparency.errors import TransparencyError
from attestation.transparency.statements import ReleaseStatement, decode_statement
from attestation.transparency.tiles import TILE_WIDTH
from transparency.reader import LogReader


@dataclass(slots=True)
class LogIndex:
    """Each distinct entry's newest index, and each release's newest index by (code, policy, model) digest."""

    size: int = 0  # entries read so far: the log's first `size`
    entries: dict[bytes, int] = field(default_factory=dict)  # SHA-256 of an entry -> its newest index
    releases: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def catch_up(self, reader: LogReader) -> None:
        """Read the entries `reader`'s checkpoint has beyond `size` (a log only grows: a smaller one is
        another log, read from its start)."""
        if reader.size < self.size:
            self.size, self.entries, self.releases = 0, {}, {}
        first_bundle = self.size // TILE_WIDTH
        for bundle_index in range(first_bundle, -(-reader.size // TILE_WIDTH)):
            for offset, entry in enumerate(reader.bundle(bundle_index)):
                index = bundle_index * TILE_WIDTH + offset
                if index >= self.size:
                    self._add(index, entry)
        self.size = reader.size

    def index_of(self, entry: bytes) -> int | None:
        return self.entries.get(hashlib.sha256(entry).digest())

    def release_index(self, code_digest: str, policy_digest: str, model_digest: str) -> int | None:
        return self.releases.get((code_digest, policy_digest, model_digest))

    def _add(self, index: int, entry: bytes) -> None:
        self.entries[hashlib.sha256(entry).digest()] = index
        try:
            statement = decode_statement(entry)
        except TransparencyError:
            return  # a monitor flags malformed entries; lookups skip them
        if isinstance(statement, ReleaseStatement):
            for model in statement.model_digests:
                self.releases[(statement.code_digest, statement.policy_digest, model)] = index
