"""The issuer's signing keys: PEM files named by their not-before time, published current + next.

Rotation with overlapping validity: the operator adds a key whose not-before
lies ahead (`veil issuer --add-key-not-before`), lists its key id in the
gateway policy beside the current one, and restarts the issuer. Until that
time the directory lists it as the next key (clients keep using the current
one); from then on it is the current key and the previous one is no longer
published or used for signing. The old id can leave the policy once the
tokens issued under it have been spent.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from issuer.errors import IssuerConfigError
from ohttp.privacypass import DirectoryKey, IssuerKey, issuer_key
from ohttp.privacypass.token_key import TOKEN_KEY_BITS

_KEY_FILE = re.compile(r"token-key-(?P<not_before>[0-9]{1,12})\.pem")


@dataclass(frozen=True, slots=True)
class DatedKey:
    key: IssuerKey
    not_before: int


class IssuerKeyring:
    """The keys in a directory, sorted by not-before; which are published and sign depends on the time."""

    def __init__(self, keys: list[DatedKey]) -> None:
        if not keys:
            raise IssuerConfigError("the key directory holds no token key; add one with --add-key-not-before")
        self._keys = sorted(keys, key=lambda dated: dated.not_before)

    def published(self, now: float) -> list[DatedKey]:
        """The current key (the newest already valid) and the next one (the first not yet valid), if any."""
        valid = [dated for dated in self._keys if dated.not_before <= now]
        upcoming = [dated for dated in self._keys if dated.not_before > now]
        return valid[-1:] + upcoming[:1]

    def directory_keys(self, now: float) -> tuple[DirectoryKey, ...]:
        return tuple(DirectoryKey(dated.key.token_key, dated.not_before) for dated in self.published(now))

    def signing_keys(self, now: float) -> list[IssuerKey]:
        return [dated.key for dated in self.published(now)]


def load_keyring(key_dir: Path) -> IssuerKeyring:
    """Every `token-key-<not_before>.pem` in `key_dir` (PKCS#8, RSA 2048)."""
    if not key_dir.is_dir():
        raise IssuerConfigError(f"the key directory {key_dir} does not exist; create it with --add-key-not-before")
    keys = _read_keys(key_dir)
    truncated = [dated.key.token_key.truncated_key_id for dated in keys]
    if len(set(truncated)) != len(truncated):
        raise IssuerConfigError("two token keys share the last byte of their key id; replace one of them")
    return IssuerKeyring(keys)


def add_key(key_dir: Path, not_before: int) -> IssuerKey:
    """Generate a key valid from `not_before`, its last key-id byte unlike any other key's, and store it (0600)."""
    key_dir.mkdir(parents=True, exist_ok=True)
    path = key_dir / f"token-key-{not_before}.pem"
    if path.exists():
        raise IssuerConfigError(f"a key with not-before {not_before} exists already; choose another time")
    taken = {dated.key.token_key.truncated_key_id for dated in _read_keys(key_dir)}
    while True:
        private_key = rsa.generate_private_key(public_exponent=65537, key_size=TOKEN_KEY_BITS)
        key = issuer_key(private_key)
        if key.token_key.truncated_key_id not in taken:
            break
    pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(pem)
    return key


def _read_keys(key_dir: Path) -> list[DatedKey]:
    keys = []
    for path in sorted(key_dir.iterdir()):
        match = _KEY_FILE.fullmatch(path.name)
        if match is not None:
            keys.append(DatedKey(_read_key(path), int(match["not_before"])))
    return keys


def _read_key(path: Path) -> IssuerKey:
    try:
        private_key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        raise IssuerConfigError(f"cannot read the token key {path.name}: it must be an unencrypted PKCS#8 PEM") from None
    if not isinstance(private_key, rsa.RSAPrivateKey) or private_key.key_size != TOKEN_KEY_BITS:
        raise IssuerConfigError(f"the token key {path.name} must be a 2048-bit RSA key")
    return issuer_key(private_key)
