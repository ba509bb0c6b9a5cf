"""The issuer's token keys in the operator's transparency log: each key it publishes is logged before it serves.

A Privacy Pass issuer that handed one user a key of their own could recognise that user's tokens. The
measured policy lists the key ids the gateway accepts; the log shows every monitor each key the issuer
ever published, so `veil log audit --policy` can flag a listed key that nobody else was shown. A key is
logged once (by its token key id) with the window [not_before, not_before + lifetime]: the keyring
retires a key when its successor becomes current, the lifetime is what the operator announces.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from attestation.transparency.errors import StatementFormatError
from attestation.transparency.note import NoteSigner
from attestation.transparency.statements import IssuerKeyStatement, decode_statement, encode_statement
from attestation.transparency.tiles import tile_count
from issuer.keys import DatedKey
from transparency.fetch import directory_fetch
from transparency.log import append_entries
from transparency.reader import LogReader

DEFAULT_LIFETIME_S = 90 * 86400


def issuer_key_statement(dated: DatedKey, lifetime_s: int = DEFAULT_LIFETIME_S) -> IssuerKeyStatement:
    return IssuerKeyStatement(dated.key.token_key.key_id.hex(), dated.not_before, dated.not_before + lifetime_s)


def logged_issuer_keys(directory: Path, signer: NoteSigner) -> frozenset[str]:
    """The token key ids of every issuer key statement in the log (read back through its signed checkpoint)."""
    reader = LogReader(directory_fetch(directory), signer.verifier)
    ids = set()
    for index in range(tile_count(reader.size, None)):
        for entry in reader.bundle(index):
            try:
                statement = decode_statement(entry)
            except StatementFormatError:
                continue  # a monitor flags it; it is no issuer key either way
            if isinstance(statement, IssuerKeyStatement):
                ids.add(statement.token_key_id)
    return frozenset(ids)


def log_issuer_keys(directory: Path, signer: NoteSigner, keys: Sequence[DatedKey],
                    lifetime_s: int = DEFAULT_LIFETIME_S) -> list[IssuerKeyStatement]:
    """Append a statement for each of `keys` the log does not hold yet; return the statements appended."""
    logged = logged_issuer_keys(directory, signer)
    statements = [issuer_key_statement(dated, lifetime_s) for dated in keys
                  if dated.key.token_key.key_id.hex() not in logged]
    if statements:
        append_entries(directory, signer, [encode_statement(statement) for statement in statements])
    return statements
