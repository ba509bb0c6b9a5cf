"""`POST /v1/embeddings`: OpenAI's embeddings endpoint, served by an embedding node's engine.

Each input is its own prefill-only engine request (`engine.pooling`), so the inputs of one call batch
with each other and with any other request, and their KV blocks are zeroed as any other's. Every field
is applied or refused by name; the vectors themselves are never logged, only their count and sizes
reach the audit (as a generation's token counts do).
"""

from __future__ import annotations

import base64
import re
import struct
import time
from dataclasses import dataclass

from engine import (EmbeddingOutput, EngineCoreClient, PoolingKind, PoolingParams, RequestMetrics, RequestRejected,
                    SamplingParams, Tokenizer)
from enclave.api_types import ApiError

# OpenAI's own bound on the inputs of one call.
MAX_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")
_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")  # anything else could be content, so it is not echoed
_UNUSED = SamplingParams(max_tokens=1, temperature=0.0)  # an embedding request picks nothing


@dataclass(frozen=True, slots=True)
class EmbeddingCall:
    """One `/v1/embeddings` body, read and checked."""

    inputs: list[str | list[int]]
    pooling: PoolingParams
    base64: bool


def read_call(body: dict, kind: PoolingKind) -> EmbeddingCall:
    """The body's inputs and settings; an ApiError naming the field for anything wrong or unknown."""
    for name in body:
        if name not in _FIELDS:
            shown = _FIELD_NAME.fullmatch(name) is not None
            raise ApiError(400, "unknown_parameter", f"unrecognized request argument{f' {name!r}' if shown else ''}: "
                           "not an embeddings field this node knows", param=name if shown else None)
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise ApiError(400, "invalid_value", "'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_integer(dimensions) or dimensions < 1):
        raise ApiError(400, "invalid_value", "'dimensions' must be a positive integer", param="dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, "invalid_type", "'user' must be a string", param="user")
    return EmbeddingCall(_inputs(body.get("input")), PoolingParams(kind, dimensions), encoding == "base64")


def _inputs(value: object) -> list[str | list[int]]:
    """`input`: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_integer(item) for item in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "invalid_value", "'input' must be a non-empty string, list of strings or list of "
                       "token id lists", param="input")
    if len(value) > MAX_INPUTS:
        raise ApiError(400, "too_many_inputs", f"'input' holds more than {MAX_INPUTS} inputs", param="input")
    for item in value:
        text = isinstance(item, str) and item
        ids = isinstance(item, list) and item and all(_is_integer(token) for token in item)
        if not (text or ids):
            raise ApiError(400, "invalid_value", "each input must be a non-empty string or a non-empty list of "
                           "integer token ids", param="input")
    return value


def embed(call: EmbeddingCall, engine: EngineCoreClient, tokenizer: Tokenizer) -> list[EmbeddingOutput]:
    """Every input's embedding, in order; one refused input refuses the call (and ends the others)."""
    prompts = [tokenizer.encode_prompt(item) if isinstance(item, str) else item for item in call.inputs]
    handles = [engine.submit(prompt, _UNUSED, call.pooling) for prompt in prompts]
    try:
        return [handle.embedding() for handle in handles]
    except RequestRejected as error:
        raise ApiError(400, error.reason, str(error),
                       param="dimensions" if error.reason == "invalid_dimensions" else "input") from None
    finally:
        for handle in handles:
            handle.close()


def answer(outputs: list[EmbeddingOutput], call: EmbeddingCall, model_name: str) -> dict:
    """OpenAI's embeddings response: a list of vectors (floats or base64 of little-endian float32) and usage."""
    data = [{"object": "embedding", "index": index, "embedding": _encoded(output.embedding, call.base64)}
            for index, output in enumerate(outputs)]
    tokens = sum(output.metrics.prompt_tokens for output in outputs)
    return {"object": "list", "data": data, "model": model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: list[float], as_base64: bool) -> list[float] | str:
    if not as_base64:
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def call_metrics(outputs: list[EmbeddingOutput]) -> RequestMetrics:
    """The call's sizes and timings for the audit: its inputs' tokens together, no output tokens."""
    return RequestMetrics(prompt_tokens=sum(output.metrics.prompt_tokens for output in outputs), output_tokens=0,
                          arrival_time=min(output.metrics.arrival_time for output in outputs), first_token_time=None,
                          finish_time=time.monotonic())


def not_an_embedding_model(model_name: str) -> ApiError:
    return ApiError(400, "model_not_embedding", f"'{model_name}' is a generation model and serves no embeddings; "
                    "ask a node started with --task embed", param="model")


def not_a_generation_model(model_name: str) -> ApiError:
    return ApiError(400, "model_not_generation", f"'{model_name}' is an embedding model: it serves /v1/embeddings "
                    "only", param="model")


def _is_integer(value: object) -> bool:
    """A true `int`: not a bool (an int subclass), not a float or string that could pass for one."""
    return isinstance(value, int) and not isinstance(value, bool)
