"""A monitor's check of a receipt against the log it audited (`veil log audit --receipt FILE`).

The node key statements of the audited log that carry the key which signed the receipt are the
candidates; the receipt must verify against one of them (`attestation.receipts.verify_against_statement`:
its key, its measurement, its validity window). So a third party learns, from the log alone, that
the answer was signed by an attested node whose key everybody can see.
"""

from __future__ import annotations

from attestation.receipts import (
    Receipt,
    ReceiptKeyError,
    ReceiptMismatchError,
    ReceiptTimeError,
    decode_receipt,
    key_id,
    verify_against_statement,
)
from attestation.transparency.statements import NodeKeyStatement
from transparency.audit import AuditedEntry


def logged_statement_for(entries: list[AuditedEntry], data: bytes) -> tuple[AuditedEntry, Receipt]:
    """The log entry whose node key statement vouches for the receipt `data`, and the receipt; else the
    ReceiptError of the closest statement (none carrying its key: ReceiptKeyError)."""
    receipt = decode_receipt(data)
    candidates = [entry for entry in entries if isinstance(entry.statement, NodeKeyStatement)
                  and key_id(bytes.fromhex(entry.statement.receipt_key)) == receipt.key_id]
    if not candidates:
        raise ReceiptKeyError("no node key statement of the log carries the key that signed the receipt")
    refusal: ReceiptMismatchError | ReceiptTimeError | None = None
    for entry in candidates:
        try:
            return entry, verify_against_statement(data, entry.statement)  # type: ignore[arg-type]
        except (ReceiptMismatchError, ReceiptTimeError) as error:  # another statement of the key may fit
            refusal = error
    assert refusal is not None
    raise refusal
