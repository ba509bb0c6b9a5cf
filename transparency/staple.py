"""The log's side of stapled proofs: an entry with its tlog-proof against the current cosigned checkpoint.

A node (or the operator for it) fetches these as the log grows and staples them to its evidence;
`attestation.transparency.client_check` verifies them offline.
"""

from __future__ import annotations

from attestation.transparency.client_check import ProofBundle, StapledEntry
from attestation.transparency.proof import TlogProof
from transparency.reader import LogReader


def stapled_entry(reader: LogReader, index: int) -> StapledEntry:
    """Entry `index` with its inclusion proof in the reader's checkpoint (as served, cosignatures included)."""
    proof = TlogProof(index, tuple(reader.inclusion_proof(index)), reader.checkpoint_note)
    return StapledEntry(reader.entry(index), proof.encode())


def proof_bundle(reader: LogReader, release_index: int, key_index: int) -> ProofBundle:
    return ProofBundle(stapled_entry(reader, release_index), stapled_entry(reader, key_index))
