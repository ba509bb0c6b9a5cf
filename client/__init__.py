"""Veil's SDK (`Client`, published as `veil.Client`) and the local OpenAI-compatible proxy.

The SDK verifies every node it may send to under its own policy and encrypts
each request end to end; see `client.sdk`. Names are loaded on first use so
that the `veil` command line starts without loading the SDK's dependencies.
The command line and the local fleet live in `veil`, which this package never imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Client": "client.sdk",
    "Stream": "client.streaming",
    "VeilClientError": "client.errors",
    "NoVerifiedNodeError": "client.errors",
    "GatewayError": "client.errors",
    "NodeError": "client.errors",
    "ModelNotFoundError": "client.errors",
    "ModelTaskError": "client.errors",
    "StreamTruncatedError": "client.errors",
    "ResponseIntegrityError": "client.errors",
    "ReceiptRefusedError": "client.errors",
    "TokenIssuanceError": "client.errors",
    "TokenPolicyError": "client.errors",
    "TokenWallet": "client.tokens",
    "ChatCompletion": "client.types",
    "ChatCompletionChunk": "client.types",
    "Completion": "client.types",
    "ModelList": "client.types",
    "Route": "client.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
