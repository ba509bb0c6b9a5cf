"""Whole encapsulated requests and responses (RFC 9458 section 4).

Client:   `blob, ctx = ClientRequest.encapsulate(config, bhttp_request)`, send `blob`,
          then `ctx.open_response(reply)`.
Gateway:  `bhttp_request, ctx = decapsulate_request(keyring, blob)`, handle it,
          then send `ctx.seal_response(bhttp_response)`.

Each request gets a fresh HPKE context, and a response can only be opened with
the context of the request it answers.
"""

from __future__ import annotations

from . import hpke
from .encapsulation import (
    REQUEST_HEADER_LENGTH,
    RequestHeader,
    client_setup,
    derive_response_key,
    enc_length,
    fresh_response_nonce,
    gateway_key,
    gateway_setup,
    response_nonce_length,
)
from .errors import MalformedError
from .keys import KeyConfig, KeyRing, SymmetricSuite

REQUEST_LABEL = b"message/bhttp request"
RESPONSE_LABEL = b"message/bhttp response"


class ClientContext:
    """The client's state for one request: opens the one response that answers it."""

    __slots__ = ("_context", "_enc", "suite")

    def __init__(self, context: hpke.SenderContext, enc: bytes, suite: SymmetricSuite) -> None:
        self._context = context
        self._enc = enc
        self.suite = suite

    def open_response(self, encapsulated_response: bytes) -> bytes:
        """Authenticate and decrypt the gateway's response.

        Raises MalformedError if it is too short and DecryptionError if it was
        altered or belongs to another request.
        """
        nonce_length = response_nonce_length(self.suite)
        tag_length = hpke.aead_for(self.suite.aead_id).tag_length
        data = memoryview(encapsulated_response)  # a view: large responses are not copied
        if len(data) < nonce_length + tag_length:
            raise MalformedError("the encapsulated response is shorter than its nonce and tag; it is cut short")
        response_nonce = bytes(data[:nonce_length])
        key = derive_response_key(self._context, self.suite, self._enc, response_nonce, RESPONSE_LABEL)
        return key.key.open(key.nonce, data[nonce_length:])


class ClientRequest:
    """Client side of RFC 9458: seals one request to a gateway's key configuration."""

    @staticmethod
    def encapsulate(
        config: KeyConfig,
        plaintext: bytes,
        suite: SymmetricSuite | None = None,
        *,
        _ephemeral_private_key_for_tests: bytes | None = None,
    ) -> tuple[bytes, ClientContext]:
        """Return the encapsulated request and the context that opens its response.

        `suite` defaults to the configuration's first implemented suite. The
        ephemeral-key argument exists only to reproduce published test vectors.
        """
        setup = client_setup(config, suite, REQUEST_LABEL, _ephemeral_private_key_for_tests)
        sealed = setup.context.seal(bytes(plaintext))
        return setup.prefix + sealed, ClientContext(setup.context, setup.enc, setup.suite)


class ServerContext:
    """The gateway's state for one request: seals the response to it."""

    __slots__ = ("_context", "_enc", "suite", "key_id")

    def __init__(self, context: hpke.RecipientContext, enc: bytes, suite: SymmetricSuite, key_id: int) -> None:
        self._context = context
        self._enc = enc
        self.suite = suite
        self.key_id = key_id

    def seal_response(self, plaintext: bytes, *, _response_nonce_for_tests: bytes | None = None) -> bytes:
        """Encapsulate the response under a key derived from this request's context.

        The response-nonce argument exists only to reproduce published test vectors.
        """
        response_nonce = fresh_response_nonce(self.suite, _response_nonce_for_tests)
        key = derive_response_key(self._context, self.suite, self._enc, response_nonce, RESPONSE_LABEL)
        return response_nonce + key.key.seal(key.nonce, plaintext)


def decapsulate_request(keyring: KeyRing, encapsulated: bytes) -> tuple[bytes, ServerContext]:
    """Open an encapsulated request with the key it names.

    Raises MalformedError (bad layout), UnknownKeyError (key id not held),
    UnsupportedSuiteError (algorithms not accepted) or DecryptionError.
    """
    data = memoryview(encapsulated)  # a view: large requests are not copied
    header = RequestHeader.decode(data)
    pair = gateway_key(keyring, header)
    ciphertext_at = REQUEST_HEADER_LENGTH + enc_length(header.kem_id)
    tag_length = hpke.aead_for(header.aead_id).tag_length
    if len(data) < ciphertext_at + tag_length:
        raise MalformedError("the encapsulated request is shorter than its header, key share and tag")
    setup = gateway_setup(pair, header, bytes(data[REQUEST_HEADER_LENGTH:ciphertext_at]), REQUEST_LABEL)
    plaintext = setup.context.open(data[ciphertext_at:])
    return plaintext, ServerContext(setup.context, setup.enc, header.suite, header.key_id)
