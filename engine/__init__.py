"""The stateless paged-KV engine.

This module's names are the engine's whole public surface: a node submits requests to an
`EngineCoreClient` and reads deltas and zeroing reports back; offline users run an `LLMEngine`.

Continuous batching over a paged KV cache whose blocks are zeroed on free; prefix sharing only
between the samples of one request; nothing written to disk; no content in logs or errors.

Names are loaded on first use, so that `veil` subcommands that never touch the engine do not
pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ChatMessage": "engine.tokenizer",
    "CompletionOutput": "engine.outputs",
    "EmbeddingOutput": "engine.pooling",
    "EngineConfig": "engine.config",
    "EngineCoreClient": "engine.core_client",
    "EngineError": "engine.errors",
    "FinishReason": "engine.sequence",
    "JSON_OPTIONS": "engine.structured",  # the JSON options every constraint compiles with (llguidance's)
    "JSON_OPTIONS_KEY": "engine.structured",  # where a schema carries options of its own
    "LLMEngine": "engine.llm_engine",
    "ModelConfig": "engine.config",
    "ModelLoadError": "engine.errors",
    "PoolingKind": "engine.pooling",
    "PoolingParams": "engine.pooling",
    "RequestHandle": "engine.core_client",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "RequestRejected": "engine.errors",
    "SamplingParams": "engine.sampling_params",
    "StreamDelta": "engine.outputs",
    "StructuredOutput": "engine.sampling_params",
    "THINK_CLOSE": "engine.reasoning_grammar",  # a reasoning block's markers, as constraints write them
    "THINK_OPEN": "engine.reasoning_grammar",
    "TokenLogprob": "engine.sequence",
    "Tokenizer": "engine.tokenizer",
    "ToolCall": "engine.chat_template",
    "UnknownRequestError": "engine.errors",
    "ZeroingReport": "engine.accounting",
    "model_pooling": "engine.pooling",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.accounting import ZeroingReport
    from engine.config import EngineConfig, ModelConfig
    from engine.core_client import EngineCoreClient, RequestHandle
    from engine.errors import EngineError, ModelLoadError, RequestRejected, UnknownRequestError
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
    from engine.pooling import EmbeddingOutput, PoolingKind, PoolingParams, model_pooling
    from engine.reasoning_grammar import THINK_CLOSE, THINK_OPEN
    from engine.sampling_params import SamplingParams, StructuredOutput
    from engine.sequence import FinishReason, TokenLogprob
    from engine.structured import JSON_OPTIONS, JSON_OPTIONS_KEY
    from engine.chat_template import ToolCall
    from engine.tokenizer import ChatMessage, Tokenizer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
