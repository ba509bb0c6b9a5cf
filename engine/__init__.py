"""The stateless paged-KV engine.

Continuous batching over a paged KV cache whose blocks are zeroed on free; prefix sharing only
between the samples of one request; nothing written to disk; no content in logs or errors.

Names are loaded on first use, so that `veil` subcommands that never touch the engine do not
pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "EngineError": "engine.errors",
    "FinishReason": "engine.sequence",
    "LLMEngine": "engine.llm_engine",
    "ModelConfig": "engine.config",
    "ModelLoadError": "engine.errors",
    "RequestOutput": "engine.outputs",
    "RequestRejected": "engine.errors",
    "SamplingParams": "engine.sampling_params",
    "StreamDelta": "engine.outputs",
    "UnknownRequestError": "engine.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.errors import EngineError, ModelLoadError, RequestRejected, UnknownRequestError
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, RequestOutput, StreamDelta
    from engine.sampling_params import SamplingParams
    from engine.sequence import FinishReason


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
