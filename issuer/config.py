"""The issuer's configuration file (TOML): its name, the quota, and the accounts with their JWT keys.

    issuer_name = "issuer.example"
    request_uri = "https://issuer.example/token-request"
    tokens_per_period = 1000
    period_s = 86400

    [accounts.alice]
    algorithm = "ES256"          # or "EdDSA"
    public_key = \"\"\"-----BEGIN PUBLIC KEY-----
    ...
    -----END PUBLIC KEY-----\"\"\"
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from issuer.errors import IssuerConfigError

ALGORITHMS = {"ES256": ec.EllipticCurvePublicKey, "EdDSA": ed25519.Ed25519PublicKey}
_ACCOUNT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True, slots=True)
class Account:
    """A registered account: its name (the JWT `sub` and `kid`) and the key its credentials are signed with."""

    name: str
    algorithm: str
    public_key: ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey = field(repr=False)


@dataclass(frozen=True, slots=True)
class IssuerConfig:
    issuer_name: str
    request_uri: str
    tokens_per_period: int
    period_s: float
    accounts: dict[str, Account]


def load_config(path: Path) -> IssuerConfig:
    """Read and check the configuration file, or raise IssuerConfigError saying what to fix."""
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:  # in words: a missing file is the likeliest mistake on the command line
        raise IssuerConfigError(f"cannot read the issuer configuration {path}: {error.strerror}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise IssuerConfigError(f"cannot read the issuer configuration {path}: {type(error).__name__}") from None
    return parse_config(document)


def parse_config(document: dict[str, object]) -> IssuerConfig:
    issuer_name = document.get("issuer_name")
    if not isinstance(issuer_name, str) or not issuer_name.isascii() or not issuer_name:
        raise IssuerConfigError("issuer_name must be a non-empty ASCII string (the issuer's host name)")
    request_uri = document.get("request_uri", f"https://{issuer_name}/token-request")
    tokens = document.get("tokens_per_period", 1000)
    period_s = document.get("period_s", 86400)
    if not isinstance(request_uri, str) or not _positive(tokens) or not _positive(period_s):
        raise IssuerConfigError("request_uri must be a string; tokens_per_period and period_s positive numbers")
    accounts_table = document.get("accounts", {})
    if not isinstance(accounts_table, dict):
        raise IssuerConfigError("accounts must be a table of [accounts.NAME] entries")
    accounts = {name: _account(name, entry) for name, entry in accounts_table.items()}
    return IssuerConfig(issuer_name, request_uri, int(tokens), float(period_s), accounts)


def _account(name: str, entry: object) -> Account:
    if not _ACCOUNT_NAME.fullmatch(name) or not isinstance(entry, dict):
        raise IssuerConfigError("each account needs a name of 1-64 letters, digits, '.', '_' or '-' and a table")
    algorithm = entry.get("algorithm")
    pem = entry.get("public_key")
    if algorithm not in ALGORITHMS or not isinstance(pem, str):
        raise IssuerConfigError(f"account {name}: algorithm must be ES256 or EdDSA and public_key a PEM string")
    try:
        public_key = serialization.load_pem_public_key(pem.encode())
    except ValueError:
        raise IssuerConfigError(f"account {name}: public_key is not a PEM public key") from None
    if not isinstance(public_key, ALGORITHMS[algorithm]) or (
        isinstance(public_key, ec.EllipticCurvePublicKey) and not isinstance(public_key.curve, ec.SECP256R1)
    ):
        raise IssuerConfigError(f"account {name}: the key does not match {algorithm} (ES256 needs P-256)")
    return Account(name=name, algorithm=algorithm, public_key=public_key)


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0
