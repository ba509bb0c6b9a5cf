"""Veil: private LLM inference on attested confidential-computing GPU nodes.

The distribution's namespace and its composition root. `from veil import Client` is the SDK
(`client`): it verifies every node it may send to and encrypts each request end to end.
`LLMEngine`, `SamplingParams` and `EngineConfig` run the engine offline, with no node or gateway.
The command line (`veil.cli`) and the local fleet (`veil.fleet`) live here too, apart from the SDK.

Names are loaded on first use, so `import veil` imports neither torch nor the gateway.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name and the package that defines it; `veil.X` is that package's own object.
_EXPORTS = {
    "ChatCompletion": "client",
    "ChatCompletionChunk": "client",
    "Client": "client",
    "Completion": "client",
    "EngineConfig": "engine",
    "GatewayError": "client",
    "LLMEngine": "engine",
    "ModelList": "client",
    "ModelNotFoundError": "client",
    "ModelTaskError": "client",
    "NoVerifiedNodeError": "client",
    "NodeError": "client",
    "ReceiptRefusedError": "client",
    "ResponseIntegrityError": "client",
    "Route": "client",
    "SamplingParams": "engine",
    "Stream": "client",
    "StreamTruncatedError": "client",
    "TokenIssuanceError": "client",
    "TokenPolicyError": "client",
    "TokenWallet": "client",
    "VeilClientError": "client",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from client import (
        ChatCompletion,
        ChatCompletionChunk,
        Client,
        Completion,
        GatewayError,
        ModelList,
        ModelNotFoundError,
        ModelTaskError,
        NodeError,
        NoVerifiedNodeError,
        ReceiptRefusedError,
        ResponseIntegrityError,
        Route,
        Stream,
        StreamTruncatedError,
        TokenIssuanceError,
        TokenPolicyError,
        TokenWallet,
        VeilClientError,
    )
    from engine import EngineConfig, LLMEngine, SamplingParams


def __getattr__(name: str) -> Any:
    package = _EXPORTS.get(name)
    if package is None:
        raise AttributeError(f"module 'veil' has no attribute {name!r}")
    value = getattr(importlib.import_module(package), name)
    globals()[name] = value
    return value
