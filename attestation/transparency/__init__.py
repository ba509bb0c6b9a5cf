"""Verifiable transparency: the C2SP formats of a witnessed Merkle log, parsed and verified.

Pure Python over `cryptography`: RFC 6962/9162 Merkle proofs (`merkle`), signed notes and keys
(`note`), checkpoints (`checkpoint`), witness cosignatures (`cosignature`), tiles and entry bundles
(`tiles`), the trust policy (`policy`) and the statements Veil logs (`statements`). Every refusal
is a `TransparencyError`, part of the attestation hierarchy. The log itself, its witness and its
monitor live in `transparency`.
"""
