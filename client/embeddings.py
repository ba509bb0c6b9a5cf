"""`client.embeddings`: OpenAI's embeddings, served by embedding nodes (`veil node --task embed`).

The answer is kept as the node sent it: with `encoding_format="base64"` each vector is the base64 of its
little-endian float32 values (what OpenAI's SDK asks for and decodes itself), else a list of floats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from client.resources import Sender, _body, _parsed
from client.types import Route, _get, _list, _Receipted, _wire


@dataclass(frozen=True, slots=True)
class Embedding:
    object: str
    index: int
    embedding: tuple[float, ...] | str  # a string: base64 of little-endian float32

    @classmethod
    def from_dict(cls, data: Any) -> Embedding:
        vector = _get(data, "embedding", (list, str))
        if isinstance(vector, list):
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vector):
                raise ValueError("an embedding holds a value that is not a number")
            vector = tuple(float(x) for x in vector)
        return cls(_get(data, "object", str, "embedding"), _get(data, "index", int), vector)


@dataclass(frozen=True, slots=True)
class EmbeddingUsage:
    prompt_tokens: int
    total_tokens: int

    @classmethod
    def from_dict(cls, data: Any) -> EmbeddingUsage:
        prompt = _get(data, "prompt_tokens", int)
        return cls(prompt, _get(data, "total_tokens", int, prompt))


@dataclass(frozen=True, slots=True)
class CreateEmbeddingResponse(_Receipted):
    object: str
    data: tuple[Embedding, ...]
    model: str
    usage: EmbeddingUsage
    route: Route | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, data: Any, route: Route | None = None) -> CreateEmbeddingResponse:
        return cls(_get(data, "object", str, "list"), tuple(Embedding.from_dict(e) for e in _list(data, "data")),
                   _get(data, "model", str, ""), EmbeddingUsage.from_dict(_get(data, "usage", dict)), route)

    def to_dict(self) -> dict[str, Any]:
        return _wire(self)


class Embeddings:
    """`client.embeddings`: vectors of texts or token ids, pooled inside an attested node."""

    def __init__(self, client: Sender) -> None:
        self._client = client

    def create(
        self,
        *,
        model: str,
        input: str | Sequence[Any],  # noqa: A002 - OpenAI's name for it
        encoding_format: str | None = None,
        dimensions: int | None = None,
        user: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> CreateEmbeddingResponse:
        """One vector per input (a string, a list of strings, token ids or lists of token ids), normalized;
        `dimensions` keeps the first that many components, renormalized. The node refuses any other field by name."""
        if not isinstance(input, (str, list, tuple)):
            raise ValueError("input must be a string or a list of strings or token ids")
        body = _body(model=model, input=input if isinstance(input, str) else list(input),
                     encoding_format=encoding_format, dimensions=dimensions, user=user) | (extra_body or {})
        data, route = self._client.request("POST", "/v1/embeddings", body)
        return _parsed(lambda d: CreateEmbeddingResponse.from_dict(d, route), route.node_id)(data)
