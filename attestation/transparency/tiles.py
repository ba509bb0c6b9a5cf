"""C2SP tlog-tiles: where a log's hashes and entries live, and how a tree is read back from them.

A tile at level L holds up to 256 consecutive hashes of complete subtrees of height 8 * L (level 0:
leaf hashes). Tile N of level L is at `tile/<L>/<N>`, a partial one of W hashes at
`tile/<L>/<N>.p/<W>`; N is written in groups of three digits, all but the last prefixed with `x`
(1234067 -> `x001/x234/067`). Entry bundles sit beside them at `tile/entries/<N>[.p/<W>]`, each
entry a big-endian uint16 length then its bytes. Tiles never change once full, so any HTTP file
server or cache can serve a log.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from attestation.transparency.errors import TileError
from attestation.transparency.merkle import HASH_SIZE, node_hash

TILE_HEIGHT = 8
TILE_WIDTH = 1 << TILE_HEIGHT
MAX_ENTRY_BYTES = 0xFFFF
# A fetch returns a path's bytes, or None when the path does not exist.
Fetch = Callable[[str], "bytes | None"]


def encode_index(index: int) -> str:
    if index < 0:
        raise ValueError("a tile index is not negative")
    groups = []
    while True:
        groups.append(f"{index % 1000:03d}")
        index //= 1000
        if index == 0:
            break
    groups.reverse()
    return "/".join([f"x{group}" for group in groups[:-1]] + [groups[-1]])


def decode_index(encoded: str) -> int:
    """The inverse of encode_index; raise TileError on anything else."""
    *leading, last = encoded.split("/")
    if not all(len(part) == 4 and part[0] == "x" and part[1:].isdigit() for part in leading):
        raise TileError("a tile index's leading elements must be x and three digits")
    if not (len(last) == 3 and last.isascii() and last.isdigit()):
        raise TileError("a tile index's last element must be three digits")
    value = int("".join(part[1:] for part in leading) + last)
    if encode_index(value) != encoded:
        raise TileError("a tile index must be written without leading zero groups")
    return value


@dataclass(frozen=True, slots=True)
class TileName:
    """A tile (level >= 0) or an entry bundle (level None), and its width (256 when full)."""

    level: int | None
    index: int
    width: int = TILE_WIDTH

    def path(self) -> str:
        level = "entries" if self.level is None else str(self.level)
        partial = "" if self.width == TILE_WIDTH else f".p/{self.width}"
        return f"tile/{level}/{encode_index(self.index)}{partial}"


def parse_tile_path(path: str) -> TileName:
    """A tile path back to its name; raise TileError if it is not one."""
    parts = path.split("/")
    if len(parts) < 3 or parts[0] != "tile":
        raise TileError("a tile path must start with tile/<level>/")
    level = None if parts[1] == "entries" else _decimal(parts[1], "a tile level")
    rest, width = "/".join(parts[2:]), TILE_WIDTH
    if ".p/" in rest:
        rest, _, width_text = rest.partition(".p/")
        width = _decimal(width_text, "a partial tile's width")
        if not 0 < width < TILE_WIDTH:
            raise TileError("a partial tile's width must be 1 to 255")
    if level is not None and level > 63:
        raise TileError("a tile level must be below 64")
    return TileName(level, decode_index(rest), width)


def _decimal(text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit()) or (text != "0" and text.startswith("0")):
        raise TileError(f"{what} must be a decimal number with no leading zero")
    return int(text)


def tile_count(size: int, level: int | None) -> int:
    """How many tiles one level (None: entry bundles) of a tree of `size` leaves has, the last maybe partial."""
    return -(-(size >> (TILE_HEIGHT * (level or 0))) // TILE_WIDTH)


def tiles_for(size: int, level: int | None) -> Iterator[TileName]:
    """The tiles of one level (None: entry bundles) that a tree of `size` leaves has, the last maybe partial.

    Named one at a time: a checkpoint is untrusted input, and one signed over 2**40 leaves would make
    a list of 2**32 names before the first fetch showed that the log holds none of them.
    """
    count = size >> (TILE_HEIGHT * (level or 0))
    for index in range(tile_count(size, level)):
        yield TileName(level, index, min(TILE_WIDTH, count - index * TILE_WIDTH))


def parse_tile(data: bytes, width: int) -> list[bytes]:
    if len(data) != width * HASH_SIZE:
        cut = "truncated" if len(data) < width * HASH_SIZE else "extended"
        raise TileError(f"a tile of width {width} must be {width * HASH_SIZE} bytes, not {len(data)} ({cut})")
    return [data[i:i + HASH_SIZE] for i in range(0, len(data), HASH_SIZE)]


def encode_bundle(entries: list[bytes]) -> bytes:
    if any(len(entry) > MAX_ENTRY_BYTES for entry in entries):
        raise TileError(f"a log entry is larger than {MAX_ENTRY_BYTES} bytes")
    return b"".join(struct.pack(">H", len(entry)) + entry for entry in entries)


def parse_bundle(data: bytes, width: int) -> list[bytes]:
    entries, offset = [], 0
    while offset < len(data):
        if offset + 2 > len(data):
            raise TileError("an entry bundle ends inside an entry's length")
        (length,) = struct.unpack_from(">H", data, offset)
        if offset + 2 + length > len(data):
            raise TileError("an entry bundle ends inside an entry")
        entries.append(data[offset + 2:offset + 2 + length])
        offset += 2 + length
    if len(entries) != width:
        change = "entries removed" if len(entries) < width else "entries added"
        raise TileError(f"an entry bundle of width {width} holds {len(entries)} entries ({change})")
    return entries


def tile_root(hashes: list[bytes]) -> bytes:
    """The root over a power-of-two run of sibling hashes (a full tile: the subtree 8 levels above it)."""
    level = hashes
    while len(level) > 1:
        level = [node_hash(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


class TileHashes:
    """A tree of `size` leaves read from its tiles: `complete(height, index)` for merkle's proofs.

    Reads each tile once; a partial tile missing (a file server may drop it once full) falls back
    to the full tile, of which it is a prefix.
    """

    def __init__(self, fetch: Fetch, size: int) -> None:
        self._fetch, self.size, self._tiles = fetch, size, {}

    def stored(self, level: int, index: int) -> bytes:
        """The index-th hash stored at tile level `level` (a subtree of height 8 * level)."""
        if index >= self.size >> (TILE_HEIGHT * level):
            raise TileError("a hash past the tree's size was asked of its tiles")
        tile_index, offset = divmod(index, TILE_WIDTH)
        return self.tile(level, tile_index)[offset]

    def tile(self, level: int, index: int) -> list[bytes]:
        key = (level, index)
        if key not in self._tiles:
            count = self.size >> (TILE_HEIGHT * level)
            width = min(TILE_WIDTH, count - index * TILE_WIDTH)
            self._tiles[key] = self._read(TileName(level, index, width))
        return self._tiles[key]

    def _read(self, name: TileName) -> list[bytes]:
        data = self._fetch(name.path())
        if data is None and name.width < TILE_WIDTH:
            full = self._fetch(TileName(name.level, name.index).path())
            data = None if full is None else full[:name.width * HASH_SIZE]
        if data is None:
            raise TileError(f"the log has no {name.path()}")
        try:
            return parse_tile(data, name.width)
        except TileError as error:
            raise TileError(f"hash tile {name.path()}: {error}") from None

    def complete(self, height: int, index: int) -> bytes:
        """The hash of leaves [index * 2**height, (index + 1) * 2**height), from the nearest stored level."""
        level = height // TILE_HEIGHT
        span = 1 << (height - level * TILE_HEIGHT)
        hashes = [self.stored(level, index * span + i) for i in range(span)]
        return tile_root(hashes) if span > 1 else hashes[0]
