"""RFC 6962 / RFC 9162 Merkle trees: hashing, and inclusion and consistency proofs (built and verified).

Hashing: a leaf is SHA-256(0x00 || entry), an interior node SHA-256(0x01 || left || right), and a
tree of n leaves splits at the largest power of two below n. Verification follows RFC 9162
sections 2.1.3.2 and 2.1.4.2 with the conventions of transparency-dev/merkle (whose vectors the
tests run): every hash in a proof and every leaf hash must be 32 bytes, a consistency proof from
the empty tree is refused (it proves nothing), and for equal sizes the proof must be empty and
the roots equal as given.

Proofs are built over `CompleteHash`: the hash of an aligned complete subtree (2**height leaves
from index * 2**height), which a log reads from its tiles, so no proof needs every leaf.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence

from attestation.transparency.errors import ConsistencyProofError, InclusionProofError

HASH_SIZE = 32
# (height, index) -> hash of leaves [index * 2**height, (index + 1) * 2**height).
CompleteHash = Callable[[int, int], bytes]


def leaf_hash(entry: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def split_point(size: int) -> int:
    """The largest power of two strictly below `size` (size >= 2): where RFC 6962 splits a tree."""
    return 1 << ((size - 1).bit_length() - 1)


def root_of(leaf_hashes: Sequence[bytes]) -> bytes:
    """MTH over leaf hashes (all in memory); the empty tree's root is SHA-256 of nothing."""
    if not leaf_hashes:
        return hashlib.sha256(b"").digest()
    level = list(leaf_hashes)
    while len(level) > 1:
        # Pairing from the left and carrying an odd last node up equals the RFC's split at powers of two.
        paired = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = paired + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def subtree_hash(complete: CompleteHash, start: int, end: int) -> bytes:
    """MTH of leaves [start, end), start aligned as in any RFC 6962 decomposition, from complete subtrees."""
    size = end - start
    if size <= 0:
        raise ValueError("a subtree has at least one leaf")
    if size & (size - 1) == 0 and start % size == 0:
        return complete(size.bit_length() - 1, start // size)
    k = split_point(size)
    return node_hash(subtree_hash(complete, start, start + k), subtree_hash(complete, start + k, end))


def inclusion_proof(complete: CompleteHash, index: int, size: int) -> list[bytes]:
    """RFC 9162 PATH(index, D[size]), leaf first."""
    if not 0 <= index < size:
        raise InclusionProofError("the entry index is not below the tree size")
    return _path(complete, index, 0, size)


def _path(complete: CompleteHash, index: int, start: int, end: int) -> list[bytes]:
    if end - start == 1:
        return []
    k = split_point(end - start)
    if index < start + k:
        return _path(complete, index, start, start + k) + [subtree_hash(complete, start + k, end)]
    return _path(complete, index, start + k, end) + [subtree_hash(complete, start, start + k)]


def consistency_proof(complete: CompleteHash, old_size: int, new_size: int) -> list[bytes]:
    """RFC 9162 PROOF(old_size, D[new_size]); empty for equal sizes."""
    if not 0 < old_size <= new_size:
        raise ConsistencyProofError("a consistency proof needs 0 < old size <= new size")
    return _subproof(complete, old_size, 0, new_size, True)


def _subproof(complete: CompleteHash, old: int, start: int, end: int, whole: bool) -> list[bytes]:
    size = end - start
    if old == size:
        return [] if whole else [subtree_hash(complete, start, end)]
    k = split_point(size)
    if old <= k:
        return _subproof(complete, old, start, start + k, whole) + [subtree_hash(complete, start + k, end)]
    return _subproof(complete, old - k, start + k, end, False) + [subtree_hash(complete, start, start + k)]


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> None:
    """Raise InclusionProofError unless `proof` shows leaf hash `leaf` at `index` of the tree `root` of `size`."""
    if not 0 <= index < size:
        raise InclusionProofError("the entry index is not below the tree size")
    _check_hashes([leaf, *proof], InclusionProofError)
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            raise InclusionProofError("the inclusion proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0:
        raise InclusionProofError("the inclusion proof is shorter than the tree is deep")
    if not hmac.compare_digest(r, root):
        raise InclusionProofError("the inclusion proof does not lead to the tree's root")


def verify_consistency(old_size: int, new_size: int, proof: Sequence[bytes], old_root: bytes, new_root: bytes) -> None:
    """Raise ConsistencyProofError unless `proof` shows that tree (old_size, old_root) is a prefix of
    tree (new_size, new_root)."""
    if old_size > new_size or old_size < 0:
        raise ConsistencyProofError("the older tree is larger than the newer one")
    if old_size == 0:
        raise ConsistencyProofError("a consistency proof from the empty tree proves nothing; refuse it")
    if old_size == new_size:
        if proof:
            raise ConsistencyProofError("trees of equal size need an empty consistency proof")
        if not hmac.compare_digest(old_root, new_root):
            raise ConsistencyProofError("two trees of the same size have different roots")
        return
    if not proof:
        raise ConsistencyProofError("the consistency proof is empty")
    _check_hashes(proof, ConsistencyProofError)
    path = ([old_root] if old_size & (old_size - 1) == 0 else []) + list(proof)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise ConsistencyProofError("the consistency proof is longer than the trees need")
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0:
        raise ConsistencyProofError("the consistency proof is shorter than the trees need")
    if not (hmac.compare_digest(fr, old_root) and hmac.compare_digest(sr, new_root)):
        raise ConsistencyProofError("the consistency proof does not lead to both roots")


def _check_hashes(hashes: Sequence[bytes], error: type[Exception]) -> None:
    if any(len(value) != HASH_SIZE for value in hashes):
        raise error(f"every hash of a proof must be {HASH_SIZE} bytes")
