"""QUIC variable-length integers (RFC 9000 section 16), as used by Binary HTTP and chunked OHTTP.

The two most significant bits of the first byte give the encoded length
(1, 2, 4 or 8 bytes); the remaining bits hold the value, big-endian.
"""

from __future__ import annotations

from .errors import MalformedError

MAX_VARINT = (1 << 62) - 1
_LIMITS = ((1 << 6, 0x00, 1), (1 << 14, 0x40, 2), (1 << 30, 0x80, 4), (MAX_VARINT + 1, 0xC0, 8))


def encode_varint(value: int) -> bytes:
    """Encode `value` (0 ≤ value < 2**62) in its shortest form."""
    if value < 0:
        raise ValueError("a variable-length integer cannot be negative")
    for limit, prefix, length in _LIMITS:
        if value < limit:
            encoded = bytearray(value.to_bytes(length, "big"))
            encoded[0] |= prefix
            return bytes(encoded)
    raise ValueError("a variable-length integer must be below 2**62")


def varint_size(first_byte: int) -> int:
    """Number of bytes of the varint whose first byte is `first_byte`."""
    return 1 << (first_byte >> 6)


def try_decode_varint(data: bytes | bytearray | memoryview, offset: int = 0) -> tuple[int, int] | None:
    """Decode a varint at `offset`; return (value, next offset), or None if more bytes are needed."""
    if offset >= len(data):
        return None
    size = varint_size(data[offset])
    end = offset + size
    if end > len(data):
        return None
    value = int.from_bytes(data[offset:end], "big") & ((1 << (8 * size - 2)) - 1)
    return value, end


def decode_varint(data: bytes | bytearray | memoryview, offset: int = 0) -> tuple[int, int]:
    """Decode a varint at `offset`; return (value, next offset). Raises MalformedError if cut short."""
    decoded = try_decode_varint(data, offset)
    if decoded is None:
        raise MalformedError("a variable-length integer is cut short; the message is incomplete")
    return decoded
