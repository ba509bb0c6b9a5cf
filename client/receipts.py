"""The SDK's check of every answer's receipt: signed under the key the served node's evidence binds,
for the request this client sent and the body it received, under the node's model and measurement,
and dated within the policy's clock skew. A missing or refused receipt discards the answer
(`ReceiptRefusedError`); a verified one is the caller's (`answer.receipt`, `stream.receipt`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from attestation.receipts import AnswerFacts, Receipt, ReceiptError, verify_receipt
from attestation.verifier import VerifiedNode
from client.errors import ReceiptRefusedError
from client.wire import receipt_of


@dataclass(frozen=True, slots=True)
class ReceiptCheck:
    """What the receipt of one answer must prove: the request as sealed, to the node that was verified."""

    request: bytes = field(repr=False)  # the Binary HTTP request: never shown
    node: VerifiedNode
    max_skew_s: float
    clock: Callable[[], float]  # this computer's time, corrected to the nodes' clock once one refused ours

    def verify(self, trailers: tuple[tuple[bytes, bytes], ...], body_sha256: bytes, status: int) -> Receipt:
        """The answer's verified receipt, from its trailers; ReceiptRefusedError if it proves nothing."""
        facts = AnswerFacts(self.request, body_sha256, status, self.node.receipt_key, self.node.measurement)
        try:
            return verify_receipt(receipt_of(trailers), facts, self.clock(), self.max_skew_s)
        except ReceiptError as error:
            raise ReceiptRefusedError(self.node.node_id, error) from None
