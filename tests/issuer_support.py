"""An issuer configured with accounts and a key directory, for tests that run it on a real server."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from issuer.config import IssuerConfig, parse_config

ISSUER_NAME = "issuer.veil.test"


@dataclass(frozen=True)
class AccountKey:
    name: str
    algorithm: str
    private_key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey

    def public_pem(self) -> str:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ).decode()

    def credential(self, *, audience: str = ISSUER_NAME, lifetime_s: int = 60, subject: str | None = None) -> str:
        now = int(time.time())
        claims = {"sub": subject or self.name, "aud": audience, "iat": now, "exp": now + lifetime_s}
        return jwt.encode(claims, self.private_key, algorithm=self.algorithm, headers={"kid": self.name})

    def signed(self, claims: dict[str, object]) -> str:
        """A JWT of `claims` exactly as given, signed by this account's key (PyJWT's encoder checks the
        types of some claims itself, so it could not write the wrong ones that tests send)."""
        payload = json.dumps(claims).encode()
        return jwt.api_jws.encode(payload, self.private_key, algorithm=self.algorithm, headers={"kid": self.name})


def es256_account(name: str) -> AccountKey:
    return AccountKey(name, "ES256", ec.generate_private_key(ec.SECP256R1()))


def eddsa_account(name: str) -> AccountKey:
    return AccountKey(name, "EdDSA", ed25519.Ed25519PrivateKey.generate())


def issuer_config(accounts: list[AccountKey], tokens_per_period: int = 10, period_s: float = 3600) -> IssuerConfig:
    return parse_config({
        "issuer_name": ISSUER_NAME,
        "request_uri": f"https://{ISSUER_NAME}/token-request",
        "tokens_per_period": tokens_per_period,
        "period_s": period_s,
        "accounts": {a.name: {"algorithm": a.algorithm, "public_key": a.public_pem()} for a in accounts},
    })


def config_toml(accounts: list[AccountKey], tokens_per_period: int = 10) -> str:
    lines = [f'issuer_name = "{ISSUER_NAME}"', f"tokens_per_period = {tokens_per_period}", "period_s = 3600"]
    for account in accounts:
        lines += [f"[accounts.{account.name}]", f'algorithm = "{account.algorithm}"',
                  f'public_key = """{account.public_pem()}"""']
    return "\n".join(lines) + "\n"


def write_config(folder: Path, accounts: list[AccountKey], tokens_per_period: int = 10) -> Path:
    path = folder / "issuer.toml"
    path.write_text(config_toml(accounts, tokens_per_period))
    return path
