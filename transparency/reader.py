"""A log read back through its tiles: its checkpoint, entries and proofs, from a directory or a URL."""

from __future__ import annotations

from attestation.transparency.checkpoint import SignedCheckpoint, open_checkpoint
from attestation.transparency.errors import TileError
from attestation.transparency.merkle import consistency_proof, inclusion_proof
from attestation.transparency.note import NoteVerifier
from attestation.transparency.tiles import TILE_WIDTH, Fetch, TileHashes, TileName, parse_bundle
from transparency.errors import LogFetchError


class LogReader:
    """The tree of the log's current checkpoint; proofs are built from its tiles, never from all entries."""

    def __init__(self, fetch: Fetch, log_key: NoteVerifier) -> None:
        data = fetch("checkpoint")
        if data is None:
            raise LogFetchError("the log has no checkpoint")
        self.fetch = fetch
        self.checkpoint_note = data  # as served: the proofs below are against exactly this checkpoint
        self.signed: SignedCheckpoint = open_checkpoint(data, log_key)
        self.size = self.signed.checkpoint.size
        self.hashes = TileHashes(fetch, self.size)

    def bundle(self, index: int) -> list[bytes]:
        """Entry bundle `index` as of this checkpoint (a partial one falls back to its full bundle)."""
        count = self.size - index * TILE_WIDTH
        name = TileName(None, index, min(TILE_WIDTH, count))
        data, width = self.fetch(name.path()), name.width
        if data is None and name.width < TILE_WIDTH:
            data, width = self.fetch(TileName(None, index).path()), TILE_WIDTH
        if data is None:
            raise LogFetchError(f"the log has no {name.path()}")
        try:
            return parse_bundle(data, width)[:name.width]
        except TileError as error:
            raise TileError(f"entry bundle {name.path()}: {error}") from None

    def entry(self, index: int) -> bytes:
        return self.bundle(index // TILE_WIDTH)[index % TILE_WIDTH]

    def inclusion_proof(self, index: int) -> list[bytes]:
        return inclusion_proof(self.hashes.complete, index, self.size)

    def consistency_proof(self, old_size: int) -> list[bytes]:
        return consistency_proof(self.hashes.complete, old_size, self.size)
