"""What a local fleet's token issuer needs: an account, the issuer's configuration, a policy listing its key.

A fleet that demands tokens registers one account with its `veil issuer` (an ES256 key made here, the
private half kept in memory to sign the account's short-lived JWTs) and writes its own policy file:
the base policy with the issuer's name and key id in `[authorization]`. Nodes, gateway and client all
load that one file, so its digest is what the nodes measure and the client verifies.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from client.errors import VeilClientError
from policy import load_policy
from policy.shipped import resolve_policy_path

ISSUER_NAME = "issuer.veil.local"  # the name tokens carry; no such host is looked up
ORIGIN = "gateway.veil.local"  # the gateway origin tokens are bound to
RELAY_ADDRESS = "127.0.0.1"  # on loopback the relay reaches the gateway from this address
CREDENTIAL_LIFETIME_S = 60
_PRINTED_KEY_ID = re.compile(r"added token key (?P<key_id>[0-9a-f]{64}) ")


class FleetError(VeilClientError):
    """A local fleet could not start or stop as asked."""


@dataclass(frozen=True, slots=True)
class FleetAccount:
    """The one account a local fleet registers with its issuer."""

    name: str
    private_key: ec.EllipticCurvePrivateKey = field(repr=False)

    @classmethod
    def generate(cls, name: str) -> FleetAccount:
        return cls(name, ec.generate_private_key(ec.SECP256R1()))

    def credential(self) -> str:
        """A fresh JWT for this account, valid at the fleet's issuer for a minute."""
        now = int(time.time())
        claims = {"sub": self.name, "aud": ISSUER_NAME, "iat": now, "exp": now + CREDENTIAL_LIFETIME_S}
        return jwt.encode(claims, self.private_key, algorithm="ES256", headers={"kid": self.name})

    def public_pem(self) -> str:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode("ascii")


def write_issuer_config(path: Path, account: FleetAccount, tokens_per_period: int) -> Path:
    """The issuer's TOML configuration: its name, a quota per hour, and `account`'s public key."""
    lines = [f'issuer_name = "{ISSUER_NAME}"', f"tokens_per_period = {tokens_per_period}", "period_s = 3600",
             f"[accounts.{account.name}]", 'algorithm = "ES256"', f'public_key = """{account.public_pem()}"""']
    path.write_text("\n".join(lines) + "\n", encoding="ascii")
    return path


def printed_key_id(output: str) -> str:
    """The key id `veil issuer --add-key-not-before` printed."""
    found = _PRINTED_KEY_ID.search(output)
    if found is None:
        raise FleetError("veil issuer did not print the id of the key it added")
    return found["key_id"]


def write_policy_listing(path: Path, base_policy: str, key_ids: tuple[str, ...]) -> Path:
    """`base_policy` (a shipped name or a file) with the fleet's issuer and `key_ids` in [authorization]."""
    text = resolve_policy_path(base_policy).read_text(encoding="utf-8")
    listed = ", ".join(f'"{key_id}"' for key_id in key_ids)
    for empty, filled in (('issuer_name = ""', f'issuer_name = "{ISSUER_NAME}"'),
                          ("issuer_keys = []", f"issuer_keys = [{listed}]")):
        if text.count(empty) != 1:
            raise FleetError(f"a fleet with tokens needs a base policy whose [authorization] section is "
                                   f"empty (issuer_name = \"\", issuer_keys = []); {base_policy} is not")
        text = text.replace(empty, filled)
    path.write_text(text, encoding="utf-8")
    if set(load_policy(path).authorization.issuer_keys) != set(key_ids):
        raise FleetError(f"the policy written to {path} does not list the issuer's key")
    return path
