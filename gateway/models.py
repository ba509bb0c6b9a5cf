"""The REST API's bodies, as typed models (the OpenAPI schema documents them)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ohttp.media_types import OHTTP_CHUNKED_REQUEST, OHTTP_CHUNKED_RESPONSE, OHTTP_REQUEST, OHTTP_RESPONSE
from protocol.constants import MAX_CANDIDATES, MAX_ENCAPSULATED_BYTES, NODE_ID_PATTERN
from serving.errors import MalformedRequestError, RequestTooLargeError

RESPONSE_MEDIA_TYPES: dict[str, str] = {OHTTP_REQUEST: OHTTP_RESPONSE, OHTTP_CHUNKED_REQUEST: OHTTP_CHUNKED_RESPONSE}
RequestMediaType = Literal["message/ohttp-req", "message/ohttp-chunked-req"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class InferCandidate(_Strict):
    """One encapsulation of the request, sealed to the key of node `node_id`."""

    node_id: str = Field(pattern=NODE_ID_PATTERN)
    media_type: RequestMediaType
    encapsulated: str = Field(min_length=1, description="the OHTTP request, standard base64")


class InferBody(_Strict):
    """`POST /v1/infer`: the client's candidates; the gateway forwards exactly one."""

    candidates: list[InferCandidate] = Field(min_length=1, max_length=MAX_CANDIDATES)


class DirectoryNode(_Strict):
    """One admitted node as the directory publishes it (never its address)."""

    node_id: str
    key_config: str = Field(description="the node's OHTTP key configuration, standard base64")
    evidence: str = Field(description="the node's evidence bundle (JSON), bound to the gateway's last nonce")
    capacity: int
    attestation_result: str = Field(description="ES384 JWT: what this gateway verified at admission")
    models: list[str] = Field(description="the model names the node serves, as it states them (not attested)")
    task: Literal["generate", "embed"] = Field(
        "generate", description="what the node's models do, as it states it (not attested): generate (chat, "
        "completions, responses) or embed (/v1/embeddings only); absent: generate")
    transparency: str = Field("", description="the node's stapled transparency-log proofs (JSON), published unread "
                              "for clients to verify; empty: none")


class Directory(_Strict):
    """`GET /v1/nodes`: the same for every caller."""

    version: Literal[1] = 1
    nodes: list[DirectoryNode]
    policy_digest: str


class RegisterBody(_Strict):
    """`POST /v1/nodes/register`: a node asking to be attested and admitted."""

    address: str = Field(max_length=300)


class ErrorDetail(_Strict):
    """OpenAI's error object; `param` is always null, since the gateway reads no request field."""

    message: str
    type: str
    param: None = None
    code: str


class ErrorBody(_Strict):
    """Every error answer: a fixed code and sentence, never an echo of the request."""

    error: ErrorDetail


@dataclass(frozen=True, slots=True)
class Candidate:
    """A parsed candidate: node id, request media type and the ciphertext bytes."""

    node_id: str
    media_type: str
    encapsulated: bytes


def parse_infer_body(body: bytes, max_candidates: int) -> tuple[Candidate, ...]:
    """Validate an infer body; raise MalformedRequestError saying what the format is."""
    try:
        parsed = InferBody.model_validate_json(body)
    except ValidationError:
        raise MalformedRequestError(
            "the body must be JSON {\"candidates\": [{\"node_id\", \"media_type\", \"encapsulated\"}, ...]} "
            f"with 1 to {MAX_CANDIDATES} candidates, hex node ids, an OHTTP request media type and base64 ciphertext"
        ) from None
    if len(parsed.candidates) > max_candidates:
        raise MalformedRequestError(f"at most {max_candidates} candidates are accepted per request")
    candidates = tuple(Candidate(c.node_id, c.media_type, _b64decode(c.encapsulated)) for c in parsed.candidates)
    if any(len(candidate.encapsulated) > MAX_ENCAPSULATED_BYTES for candidate in candidates):
        raise RequestTooLargeError(f"each encapsulated request must be at most {MAX_ENCAPSULATED_BYTES} bytes")
    if len({candidate.node_id for candidate in candidates}) != len(candidates):
        raise MalformedRequestError("each candidate must name a different node")
    return candidates


class AttestBody(_Strict):
    """`POST /v1/nodes/{node_id}/attest`: a client's own freshness challenge, 32 bytes as 64 hex digits."""

    nonce: str = Field(pattern=r"^[0-9a-f]{64}$")


def parse_attest_body(body: bytes) -> bytes:
    try:
        return bytes.fromhex(AttestBody.model_validate_json(body).nonce)
    except ValidationError:
        raise MalformedRequestError("the body must be JSON {\"nonce\": \"<64 lowercase hex digits>\"}") from None


def parse_register_body(body: bytes) -> str:
    try:
        return RegisterBody.model_validate_json(body).address
    except ValidationError:
        raise MalformedRequestError("the body must be JSON {\"address\": \"host:port\"}") from None


def _b64decode(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedRequestError("each candidate's encapsulated field must be standard base64") from None
