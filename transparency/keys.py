"""Files the log commands read and write: keys, statements and an auditor's trusted digests."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from attestation.transparency.encoded_keys import parse_signer, parse_verifier
from attestation.transparency.errors import StatementFormatError
from attestation.transparency.note import NoteSigner, NoteVerifier
from attestation.transparency.statements import encode_statement, statement_from_value
from transparency.errors import LogStoreError

MAX_FILE_BYTES = 1 << 20
_DIGEST = re.compile(r"[0-9a-f]{64}")


def write_key(path: Path, encoded: str) -> None:
    """Write a private key readable by this user only; never overwrite one."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise LogStoreError(f"{path} exists; a key is never overwritten, choose another path") from None
    except OSError as error:
        raise LogStoreError(f"cannot write {path} ({error.strerror})") from None
    with os.fdopen(descriptor, "w", encoding="ascii") as file:
        file.write(encoded + "\n")


def _read_text(path: Path, what: str) -> str:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise LogStoreError(f"{what} {path} is larger than 1 MiB")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        raise LogStoreError(f"cannot read {what} {path}") from None


def read_signer(path: Path) -> NoteSigner:
    return parse_signer(_read_text(path, "the key file"))


def read_verifier(value: str) -> NoteVerifier:
    """A public key given inline (name+hash+base64) or as a file holding one."""
    path = Path(value)
    return parse_verifier(_read_text(path, "the key file") if "+" not in value or path.is_file() else value)


def read_statements(path: Path) -> list[bytes]:
    """A JSON file of one statement or a list of them, as canonical log entries."""
    try:
        value = json.loads(_read_text(path, "the statement file"))
    except ValueError:
        raise StatementFormatError(f"{path} is not JSON") from None
    items = value if isinstance(value, list) else [value]
    entries = []
    for number, item in enumerate(items):
        try:
            entries.append(encode_statement(statement_from_value(item)))
        except StatementFormatError as error:
            raise StatementFormatError(f"{path}, statement {number}: {error}") from None
    return entries


def read_trusted(path: Path) -> frozenset[str]:
    digests = [line.split("#", 1)[0].strip() for line in _read_text(path, "the trusted list").splitlines()]
    digests = [digest for digest in digests if digest]
    if not all(_DIGEST.fullmatch(digest) for digest in digests):
        raise LogStoreError(f"{path}: every line must be a SHA-256 code digest in lowercase hex")
    return frozenset(digests)
