"""Cost of Veil's wire protocol: OHTTP per-request overhead and chunked-response throughput.

Run: .venv/bin/python benchmarks/ohttp.py

Prints, for the default suite (X25519, HKDF-SHA256, AES-128-GCM):
- per request: encapsulate + decapsulate (µs) for a small and a 64 KiB request,
  and the full exchange including the sealed response;
- chunked responses: seal + open throughput (MB/s) with 16 KiB chunks and with
  64-byte chunks (one token per chunk, the streaming case).
Each figure comes with a baseline measured in the same run: the bare AES-128-GCM
seal + open of the same bytes, so the ratio is the protocol's own overhead.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

from ohttp.chunked import ChunkedRequestOpener, ChunkedRequestSealer  # noqa: E402
from ohttp.keys import KeyRing, generate_key_pair  # noqa: E402
from ohttp.message import ClientRequest, decapsulate_request  # noqa: E402

RING = KeyRing(generate_key_pair(1))
CONFIG = RING.current.config
RESPONSE_BYTES = 4 * 1024 * 1024


def best_seconds(run: Callable[[], object], repeats: int, rounds: int = 5) -> float:
    """Best mean time per call over `rounds` rounds of `repeats` calls."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def bare_aead(size: int) -> Callable[[], object]:
    """Baseline: AES-128-GCM seal and open of `size` bytes, nothing else."""
    cipher, nonce, data = AESGCM(os.urandom(16)), os.urandom(12), os.urandom(size)
    return lambda: cipher.decrypt(nonce, cipher.encrypt(nonce, data, b""), b"")


def request_round(size: int) -> Callable[[], object]:
    payload = os.urandom(size)

    def run() -> bytes:
        blob, _ = ClientRequest.encapsulate(CONFIG, payload)
        return decapsulate_request(RING, blob)[0]

    return run


def exchange_round(size: int) -> Callable[[], object]:
    payload = os.urandom(size)

    def run() -> bytes:
        blob, client = ClientRequest.encapsulate(CONFIG, payload)
        _, server = decapsulate_request(RING, blob)
        return client.open_response(server.seal_response(payload))

    return run


def chunked_response(chunk_size: int) -> tuple[float, float]:
    """(seal seconds, open seconds) for RESPONSE_BYTES in chunks of `chunk_size`."""
    sealer = ChunkedRequestSealer(CONFIG)
    gateway = ChunkedRequestOpener(RING)
    list(gateway.chunks([sealer.seal_chunk(b"request", final=True)]))
    writer, reader = gateway.response_sealer(), sealer.response_opener()
    chunk = os.urandom(chunk_size)
    count = RESPONSE_BYTES // chunk_size
    start = time.perf_counter()
    frames = [writer.seal_chunk(chunk) for _ in range(count)]
    frames.append(writer.seal_chunk(b"", final=True))
    sealed = time.perf_counter()
    opened = sum(len(c) for frame in frames for c in reader.feed(frame)) + len(reader.finish())
    done = time.perf_counter()
    assert opened == count * chunk_size
    return sealed - start, done - sealed


def chunked_baseline(chunk_size: int) -> float:
    """Seconds for bare AES-128-GCM seal + open of the same chunks with counter nonces."""
    cipher, base, chunk = AESGCM(os.urandom(16)), int.from_bytes(os.urandom(12), "big"), os.urandom(chunk_size)
    start = time.perf_counter()
    for counter in range(RESPONSE_BYTES // chunk_size):
        nonce = (base ^ counter).to_bytes(12, "big")
        cipher.decrypt(nonce, cipher.encrypt(nonce, chunk, b""), b"")
    return time.perf_counter() - start


def report_requests() -> None:
    print("Per request (X25519 / HKDF-SHA256 / AES-128-GCM)")
    for label, size, repeats in (("small (64 B)", 64, 300), ("64 KiB", 64 * 1024, 100)):
        protocol = best_seconds(request_round(size), repeats)
        exchange = best_seconds(exchange_round(size), repeats)
        baseline = best_seconds(bare_aead(size), repeats)
        print(
            f"  {label:>12}: encapsulate+decapsulate {protocol * 1e6:8.1f} µs"
            f" | with sealed response {exchange * 1e6:8.1f} µs"
            f" | bare AES-GCM seal+open {baseline * 1e6:7.1f} µs ({protocol / baseline:5.1f}x)"
        )


def report_chunked() -> None:
    megabytes = RESPONSE_BYTES / 1e6
    print(f"Chunked response ({RESPONSE_BYTES // (1024 * 1024)} MiB, seal then open)")
    for label, size in (("16 KiB chunks", 16 * 1024), ("64 B chunks", 64)):
        seal, open_ = min(chunked_response(size) for _ in range(3))
        baseline = min(chunked_baseline(size) for _ in range(3))
        total = seal + open_
        print(
            f"  {label:>14}: seal {megabytes / seal:8.1f} MB/s | open {megabytes / open_:8.1f} MB/s"
            f" | seal+open {megabytes / total:8.1f} MB/s"
            f" | bare AES-GCM {megabytes / baseline:8.1f} MB/s ({total / baseline:4.1f}x the time)"
        )
    tokens_per_second = (RESPONSE_BYTES // 64) / sum(chunked_response(64))
    print(f"  64 B chunks as a token stream: {tokens_per_second:,.0f} chunks/s sealed and opened")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    report_requests()
    report_chunked()
