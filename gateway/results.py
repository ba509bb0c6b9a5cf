"""The gateway's signing identity for attestation results (see `attestation.results`).

The directory carries, next to each node's raw evidence, an ES384 JWT signed
by this gateway's own key (generated in memory at start, never stored): what
the gateway verified at admission. Clients may audit it; they never rely on
it, and verify the evidence themselves.
"""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestation.results import issue_result
from attestation.verifier import VerifiedNode


class ResultSigner:
    """Holds the gateway's P-384 key; its id doubles as the gateway id in audit events."""

    def __init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP384R1())
        self.public_key = self._key.public_key()
        public_der = self.public_key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        # A digest of the public key: names this gateway without saying anything else about it.
        self.gateway_id = hashlib.sha256(public_der).hexdigest()[:32]
        self.issuer = f"veil-gateway:{self.gateway_id}"

    def __repr__(self) -> str:
        return f"ResultSigner(gateway_id={self.gateway_id}, key=<redacted>)"

    def public_description(self) -> dict[str, str]:
        """What a client needs to check the results this gateway signs: issuer, key id and public key."""
        pem = self.public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return {"issuer": self.issuer, "kid": self.gateway_id, "alg": "ES384", "public_key_pem": pem.decode()}

    def issue(self, node: VerifiedNode, *, now: float | None = None) -> str:
        """An ES384 JWT recording that `node` passed every check under its policy."""
        return issue_result(node, self._key, issuer=self.issuer, key_id=self.gateway_id, now=now)
