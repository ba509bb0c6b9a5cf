"""The log's side of witnessing: send the new checkpoint to each witness and staple the cosignatures."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import httpx

from attestation.transparency.note import NoteSigner, Signature
from transparency.errors import StaleSizeError, WitnessRequestError
from transparency.fetch import directory_fetch
from transparency.log import add_cosignatures
from transparency.protocol import AddCheckpoint, request_cosignature
from transparency.reader import LogReader


def cosign_checkpoint(directory: Path, signer: NoteSigner, witness_urls: Sequence[str],
                      client: httpx.Client) -> list[Signature]:
    """Ask every witness to cosign the log's current checkpoint; staple and return their cosignatures.

    The log keeps no record of where each witness is: it first claims size 0, and a witness that
    is further answers with its size, from which the log sends a consistency proof (built from tiles).
    """
    reader = LogReader(directory_fetch(directory), signer.verifier)
    note = reader.checkpoint_note
    signatures = [_cosign(client, url, reader, note) for url in witness_urls]
    add_cosignatures(directory, signer, reader.signed.checkpoint, signatures)
    return signatures


def _cosign(client: httpx.Client, url: str, reader: LogReader, note: bytes) -> Signature:
    try:
        return request_cosignature(client, url, AddCheckpoint(0, (), note))
    except StaleSizeError as stale:
        if stale.size > reader.size:
            raise WitnessRequestError(f"the witness at {url} has cosigned a larger tree ({stale.size}) than "
                                      f"this log holds ({reader.size}): the log was rolled back") from None
        proof = tuple(reader.consistency_proof(stale.size)) if stale.size else ()
        return request_cosignature(client, url, AddCheckpoint(stale.size, proof, note))
