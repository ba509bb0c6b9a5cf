"""The stateless paged-KV engine.

Continuous batching over a paged KV cache whose blocks are zeroed on free; prefix sharing only
between the samples of one request; nothing written to disk; no content in logs or errors.
"""

from engine.config import EngineConfig, ModelConfig
from engine.errors import EngineError, ModelLoadError, RequestRejected, UnknownRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason

__all__ = [
    "CompletionOutput",
    "EngineConfig",
    "EngineError",
    "FinishReason",
    "LLMEngine",
    "ModelConfig",
    "ModelLoadError",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "StreamDelta",
    "UnknownRequestError",
]
