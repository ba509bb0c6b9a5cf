"""The operator's log: statements appended to a directory of tiles, entry bundles and a signed checkpoint.

Layout (c2sp.org/tlog-tiles): `checkpoint`, `tile/<L>/<N>[.p/<W>]`, `tile/entries/<N>[.p/<W>]`.
Files are written before the checkpoint that covers them, each atomically, so a reader never
sees a checkpoint whose tiles are missing; full tiles never change and partial tiles of older
sizes are kept, so any older tree can still be read. One appender at a time holds `.lock`. The
signing key lives outside the directory: the directory is what the log publishes.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from attestation.transparency.checkpoint import Checkpoint, SignedCheckpoint, open_checkpoint
from attestation.transparency.merkle import leaf_hash, root_of, subtree_hash
from attestation.transparency.note import Note, NoteSigner, Signature, sign_note
from attestation.transparency.tiles import (
    MAX_ENTRY_BYTES,
    TILE_HEIGHT,
    TILE_WIDTH,
    TileHashes,
    TileName,
    encode_bundle,
    parse_bundle,
    parse_tile,
    tile_root,
)
from transparency.errors import LogGrewError, LogStoreError
from transparency.fetch import directory_fetch


def init_log(directory: Path, signer: NoteSigner) -> SignedCheckpoint:
    """Create an empty log signed by `signer` (its key name is the log's origin); refuse an existing one."""
    if (directory / "checkpoint").exists():
        raise LogStoreError(f"{directory} already holds a log; choose an empty directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LogStoreError(f"cannot create {directory} ({error.strerror})") from None
    with _locked(directory):
        return _write_checkpoint(directory, signer, Checkpoint(signer.name, 0, root_of([])))


def read_checkpoint(directory: Path, signer: NoteSigner) -> SignedCheckpoint:
    data = directory_fetch(directory)("checkpoint")
    if data is None:
        raise LogStoreError(f"{directory} holds no log; run `veil log init` first")
    return open_checkpoint(data, signer.verifier)


def append_entries(directory: Path, signer: NoteSigner, entries: Sequence[bytes]) -> SignedCheckpoint:
    """Append `entries` in order and sign the new checkpoint (without cosignatures: see add_cosignatures)."""
    if any(len(entry) > MAX_ENTRY_BYTES for entry in entries):
        raise LogStoreError(f"a log entry is larger than {MAX_ENTRY_BYTES} bytes; nothing was appended")
    with _locked(directory):
        old = read_checkpoint(directory, signer).checkpoint.size
        new = old + len(entries)
        fetch = directory_fetch(directory)
        _extend(directory, None, old, list(entries), encode_bundle, lambda data, width: parse_bundle(data, width))
        hashes, level = [leaf_hash(entry) for entry in entries], 0
        while hashes:
            completed = _extend(directory, level, old >> (TILE_HEIGHT * level), hashes, b"".join, parse_tile)
            hashes, level = [tile_root(tile) for tile in completed], level + 1
        root = subtree_hash(TileHashes(fetch, new).complete, 0, new) if new else root_of([])
        return _write_checkpoint(directory, signer, Checkpoint(signer.name, new, root))


def add_cosignatures(directory: Path, signer: NoteSigner, expected: Checkpoint,
                     cosignatures: Sequence[Signature]) -> None:
    """Staple witnesses' cosignatures to the checkpoint, if it is still `expected` (no append since)."""
    with _locked(directory):
        current = read_checkpoint(directory, signer)
        if current.checkpoint != expected:
            raise LogGrewError("the log grew while its witnesses cosigned; ask them again")
        # A witness's newer cosignature replaces its older one: its timestamp is what makes a proof fresh.
        fresh = {(signature.name, signature.key_id): signature for signature in cosignatures}
        kept = [signature for signature in current.note.signatures if (signature.name, signature.key_id) not in fresh]
        note = Note(current.note.text, (*kept, *fresh.values()))
        _write(directory / "checkpoint", note.encode().encode())


def _extend(directory: Path, level: int | None, count: int, items: list[bytes],
            encode: Callable[[list[bytes]], bytes], parse: Callable[[bytes, int], list[bytes]]) -> list[list[bytes]]:
    """Append `items` to a level holding `count` items; return the tiles this made full."""
    first = count // TILE_WIDTH
    held = count % TILE_WIDTH
    if held:
        path = directory / TileName(level, first, held).path()
        try:
            items = parse(path.read_bytes(), held) + items
        except FileNotFoundError:
            raise LogStoreError(f"the log lost {TileName(level, first, held).path()}; it cannot grow") from None
    completed = []
    for start in range(0, len(items), TILE_WIDTH):
        chunk = items[start:start + TILE_WIDTH]
        _write(directory / TileName(level, first + start // TILE_WIDTH, len(chunk)).path(), encode(chunk))
        if len(chunk) == TILE_WIDTH:
            completed.append(chunk)
    return completed


def _write_checkpoint(directory: Path, signer: NoteSigner, checkpoint: Checkpoint) -> SignedCheckpoint:
    data = sign_note(checkpoint.body(), signer).encode()
    _write(directory / "checkpoint", data)
    return open_checkpoint(data, signer.verifier)


def _write(path: Path, data: bytes) -> None:
    """Write atomically and durably: a reader sees the old file or the new one, never a part."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with temporary.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as error:
        raise LogStoreError(f"cannot write {path.name} in the log ({error.strerror})") from None


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    try:
        handle = (directory / ".lock").open("a")
    except OSError as error:
        raise LogStoreError(f"cannot open the log's lock in {directory} ({error.strerror})") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
