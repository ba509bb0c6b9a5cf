"""Chunked OHTTP: streaming round trips, truncation, reordering, tampering and bounds."""

from __future__ import annotations

import pytest

from ohttp.chunked import (
    ChunkedRequestOpener,
    ChunkedRequestSealer,
    ChunkedResponseOpener,
    ChunkedResponseSealer,
)
from ohttp.chunk_framing import chunk_nonce
from ohttp.errors import DecryptionError, MalformedError, OHTTPError, TruncatedError, UnknownKeyError
from ohttp.keys import SUITE_AES_256_GCM, SUITE_CHACHA20_POLY1305, KeyRing, generate_key_pair
from ohttp.varint import encode_varint

REQUEST_CHUNKS = [b"first part of the prompt", b"second part", b"third"]
RESPONSE_CHUNKS = [b"token-1", b"token-2", b"token-3", b"token-4"]
PREFIX_LENGTH = 7 + 32
NONCE_LENGTH = 16


@pytest.fixture(scope="module")
def ring() -> KeyRing:
    return KeyRing(generate_key_pair(4))


def _seal_request(ring: KeyRing, chunks=REQUEST_CHUNKS, final: bytes = b"", **kwargs) -> tuple[list[bytes], ChunkedRequestSealer]:
    sealer = ChunkedRequestSealer(ring.current.config, **kwargs)
    frames = [sealer.start()] + [sealer.seal_chunk(c) for c in chunks] + [sealer.seal_chunk(final, final=True)]
    return frames, sealer


def _open_request(ring: KeyRing, wire: bytes) -> tuple[list[bytes], ChunkedRequestOpener]:
    opener = ChunkedRequestOpener(ring)
    return list(opener.chunks([wire])), opener


def _response_frames(opener: ChunkedRequestOpener, chunks=RESPONSE_CHUNKS) -> list[bytes]:
    sealer = opener.response_sealer()
    return [sealer.start()] + [sealer.seal_chunk(c) for c in chunks] + [sealer.seal_chunk(b"", final=True)]


def _read_response(opener: ChunkedResponseOpener, pieces: list[bytes]) -> list[bytes]:
    opened = [chunk for piece in pieces for chunk in opener.feed(piece)]
    tail = opener.finish()
    return opened + ([tail] if tail else [])


def _exchange(ring: KeyRing, **kwargs) -> tuple[list[bytes], ChunkedRequestSealer]:
    frames, sealer = _seal_request(ring, **kwargs)
    _, opener = _open_request(ring, b"".join(frames))
    return _response_frames(opener), sealer


@pytest.mark.parametrize("suite", [None, SUITE_AES_256_GCM, SUITE_CHACHA20_POLY1305])
def test_streaming_round_trip(ring: KeyRing, suite) -> None:
    frames, sealer = _seal_request(ring, final=b"closing words", suite=suite)
    opened, opener = _open_request(ring, b"".join(frames))
    assert opened == REQUEST_CHUNKS + [b"closing words"]
    response = _response_frames(opener)
    assert _read_response(sealer.response_opener(), response) == RESPONSE_CHUNKS + [b""]


def test_final_empty_response_chunk_is_recognised_without_end_of_stream(ring: KeyRing) -> None:
    response, sealer = _exchange(ring)
    reader = sealer.response_opener()
    opened = reader.feed(b"".join(response))
    assert opened == RESPONSE_CHUNKS + [b""] and reader.complete
    assert reader.finish() == b""


def test_final_response_chunk_with_data_arriving_in_pieces(ring: KeyRing) -> None:
    frames, sealer = _seal_request(ring)
    _, opener = _open_request(ring, b"".join(frames))
    writer = opener.response_sealer()
    wire = writer.seal_chunk(b"a") + writer.seal_chunk(b"z" * 300, final=True)
    reader = sealer.response_opener()
    opened = [chunk for i in range(0, len(wire), 7) for chunk in reader.feed(wire[i : i + 7])]
    opened.append(reader.finish())
    assert b"".join(opened) == b"a" + b"z" * 300


def test_request_header_is_sent_once(ring: KeyRing) -> None:
    sealer = ChunkedRequestSealer(ring.current.config)
    first = sealer.seal_chunk(b"x")
    assert len(first) == PREFIX_LENGTH + 1 + 1 + 16
    assert sealer.start() == b""
    assert len(sealer.seal_chunk(b"y")) == 1 + 1 + 16


def test_sixteen_kib_chunks(ring: KeyRing) -> None:
    block = bytes(range(256)) * 64
    frames, sealer = _seal_request(ring, chunks=[block, block])
    opened, opener = _open_request(ring, b"".join(frames))
    assert opened == [block, block, b""]
    response = _response_frames(opener, [block] * 3)
    assert response[1][:4] == encode_varint(16 * 1024 + 16)
    assert _read_response(sealer.response_opener(), response) == [block] * 3 + [b""]


def test_empty_non_final_chunks_are_not_sealed(ring: KeyRing) -> None:
    sealer = ChunkedRequestSealer(ring.current.config)
    with pytest.raises(ValueError):
        sealer.seal_chunk(b"")
    frames, _ = _seal_request(ring)
    _, opener = _open_request(ring, b"".join(frames))
    with pytest.raises(ValueError):
        opener.response_sealer().seal_chunk(b"")


def test_empty_non_final_chunks_are_rejected_on_open(ring: KeyRing) -> None:
    # A peer that seals an empty non-final chunk anyway: length == tag length.
    sealer = ChunkedRequestSealer(ring.current.config)
    wire = sealer.start() + encode_varint(16) + sealer._setup.context.seal(b"")
    with pytest.raises(MalformedError):
        ChunkedRequestOpener(ring).feed(wire)
    frames, request_sealer = _seal_request(ring)
    _, opener = _open_request(ring, b"".join(frames))
    writer = opener.response_sealer()
    empty = writer._key.seal(chunk_nonce(writer._base_nonce, 0, writer._nonce_length), b"")
    with pytest.raises(MalformedError):
        request_sealer.response_opener().feed(writer.start() + encode_varint(len(empty)) + empty)


def test_sealing_after_final_is_refused(ring: KeyRing) -> None:
    frames, sealer = _seal_request(ring)
    assert sealer.finished
    with pytest.raises(ValueError):
        sealer.seal_chunk(b"more")


# --- Truncation ------------------------------------------------------------------------


def test_request_cut_anywhere_is_an_error_never_a_short_request(ring: KeyRing) -> None:
    wire = b"".join(_seal_request(ring)[0])
    for end in range(len(wire)):
        opener = ChunkedRequestOpener(ring)
        with pytest.raises(OHTTPError):
            opener.feed(wire[:end])
            opener.finish()


def test_response_cut_anywhere_is_an_error_never_a_short_answer(ring: KeyRing) -> None:
    response, sealer = _exchange(ring)
    wire = b"".join(response)
    for end in range(len(wire)):
        reader = sealer.response_opener()
        with pytest.raises((TruncatedError, DecryptionError)):
            reader.feed(wire[:end])
            reader.finish()


def test_missing_final_chunk_is_truncation(ring: KeyRing) -> None:
    response, sealer = _exchange(ring)
    reader = sealer.response_opener()
    assert reader.feed(b"".join(response[:-1])) == RESPONSE_CHUNKS
    with pytest.raises(TruncatedError):
        reader.finish()
    frames, _ = _seal_request(ring)
    opener = ChunkedRequestOpener(ring)
    assert opener.feed(b"".join(frames[:-1])) == REQUEST_CHUNKS
    with pytest.raises(TruncatedError):
        opener.finish()


def test_a_failed_stream_stays_failed(ring: KeyRing) -> None:
    response, sealer = _exchange(ring)
    reader = sealer.response_opener()
    reader.feed(b"".join(response[:-1]))
    with pytest.raises(TruncatedError):
        reader.finish()
    with pytest.raises(TruncatedError):
        reader.feed(response[-1])


# --- Reordering, dropping, duplicating -------------------------------------------------


def _rearrangements(frames: list[bytes]) -> list[list[bytes]]:
    head, body, final = frames[0], frames[1:-1], frames[-1]
    swapped = [head, body[1], body[0], *body[2:], final]
    dropped = [head, *body[1:], final]
    duplicated = [head, body[0], *body, final]
    final_early = [head, body[0], final]
    final_twice = [head, *body, final, final]
    return [swapped, dropped, duplicated, final_early + body[1:], final_twice]


def test_rearranged_request_chunks_are_detected(ring: KeyRing) -> None:
    frames, _ = _seal_request(ring)
    for arrangement in _rearrangements(frames):
        opener = ChunkedRequestOpener(ring)
        with pytest.raises(OHTTPError):
            opener.feed(b"".join(arrangement))
            opener.finish()


def test_rearranged_response_chunks_are_detected(ring: KeyRing) -> None:
    response, sealer = _exchange(ring)
    for arrangement in _rearrangements(response):
        reader = sealer.response_opener()
        with pytest.raises(OHTTPError):
            reader.feed(b"".join(arrangement))
            reader.finish()


def test_chunks_from_another_stream_are_detected(ring: KeyRing) -> None:
    response_a, sealer_a = _exchange(ring)
    response_b, _ = _exchange(ring)
    reader = sealer_a.response_opener()
    with pytest.raises(DecryptionError):
        reader.feed(response_a[0] + response_b[1])


def test_every_bit_flip_of_a_request_stream_is_detected(ring: KeyRing) -> None:
    wire = b"".join(_seal_request(ring, chunks=[b"ab", b"cd"])[0])
    for bit in range(len(wire) * 8):
        tampered = bytearray(wire)
        tampered[bit // 8] ^= 1 << (bit % 8)
        opener = ChunkedRequestOpener(ring)
        with pytest.raises(OHTTPError):
            opener.feed(bytes(tampered))
            opener.finish()


def test_every_bit_flip_of_a_response_stream_is_detected(ring: KeyRing) -> None:
    frames, sealer = _seal_request(ring)
    _, opener = _open_request(ring, b"".join(frames))
    wire = b"".join(_response_frames(opener, [b"ab", b"cd"]))
    for bit in range(len(wire) * 8):
        tampered = bytearray(wire)
        tampered[bit // 8] ^= 1 << (bit % 8)
        reader = sealer.response_opener()
        with pytest.raises(OHTTPError):
            reader.feed(bytes(tampered))
            reader.finish()


def test_data_after_the_final_response_chunk_is_refused(ring: KeyRing) -> None:
    response, sealer = _exchange(ring)
    reader = sealer.response_opener()
    reader.feed(b"".join(response))
    with pytest.raises(MalformedError):
        reader.feed(b"\x01")


# --- Bounds ----------------------------------------------------------------------------


def test_oversized_chunk_length_is_refused_before_buffering(ring: KeyRing) -> None:
    sealer = ChunkedRequestSealer(ring.current.config)
    opener = ChunkedRequestOpener(ring, max_chunk_size=1024)
    with pytest.raises(MalformedError):
        opener.feed(sealer.start() + encode_varint((1 << 62) - 1))
    frames, request_sealer = _seal_request(ring)
    _, gateway = _open_request(ring, b"".join(frames))
    reader = request_sealer.response_opener(max_chunk_size=1024)
    with pytest.raises(MalformedError):
        reader.feed(gateway.response_sealer().start() + encode_varint(1025 + 16))


def test_oversized_final_chunk_is_refused(ring: KeyRing) -> None:
    sealer = ChunkedRequestSealer(ring.current.config)
    opener = ChunkedRequestOpener(ring, max_chunk_size=64)
    opener.feed(sealer.start() + b"\x00")
    with pytest.raises(MalformedError):
        opener.feed(bytes(100))


def test_sealers_refuse_chunks_over_their_limit(ring: KeyRing) -> None:
    sealer = ChunkedRequestSealer(ring.current.config, max_chunk_size=8)
    with pytest.raises(ValueError):
        sealer.seal_chunk(bytes(9))


def test_unknown_key_is_reported_as_soon_as_the_header_arrives(ring: KeyRing) -> None:
    stranger = ChunkedRequestSealer(generate_key_pair(77).config)
    with pytest.raises(UnknownKeyError):
        ChunkedRequestOpener(ring).feed(stranger.start()[:7])


def test_response_sealer_needs_the_header(ring: KeyRing) -> None:
    with pytest.raises(ValueError):
        ChunkedRequestOpener(ring).response_sealer()
    assert isinstance(_exchange(ring)[1].response_opener(), ChunkedResponseOpener)
    assert ChunkedResponseSealer.__name__ == "ChunkedResponseSealer"
