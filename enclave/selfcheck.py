"""What a node checks before it serves: the policy it runs under allows this configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from enclave.errors import SelfCheckError
from enclave.settings import NodeSettings
from policy import Policy


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_model_len: int
    kv_cache_gib: float


def check_node_settings(settings: NodeSettings, policy: Policy, model_digest: bytes) -> EngineLimits:
    """Raises SelfCheckError naming the requirement a setting would break."""
    engine = policy.engine
    if settings.attestation == "sim" and not policy.attestation.allow_simulated:
        raise SelfCheckError(
            f"policy {policy.name!r} refuses simulated attestation (verifiable transparency); "
            "run on a confidential-computing node with --attestation nvml or tsm"
        )
    if engine.prefix_sharing not in ("request", "off"):
        raise SelfCheckError("prefix sharing beyond one request breaks stateless computation")
    if not engine.accept_unlisted_models and model_digest.hex() not in engine.allowed_model_digests:
        raise SelfCheckError(
            f"the model weights' digest is not in policy {policy.name!r}'s allowlist (verifiable transparency)"
        )
    budget_gib = engine.kv_budget_mib / 1024
    requested = settings.kv_cache_gib if settings.kv_cache_gib is not None else budget_gib
    if requested > budget_gib:
        raise SelfCheckError(f"a KV pool of {requested} GiB exceeds the policy's budget of {budget_gib:g} GiB")
    if settings.capacity < 1:
        raise SelfCheckError("capacity must be at least 1 concurrent request")
    if settings.capacity > policy.routing.max_node_capacity:
        raise SelfCheckError(
            f"a capacity of {settings.capacity} exceeds policy {policy.name!r}'s max_node_capacity of "
            f"{policy.routing.max_node_capacity} (non-targetability: a larger claim draws more users to one node)"
        )
    if not (Path(settings.model) / "config.json").is_file():
        raise SelfCheckError(f"no model folder at {settings.model}")
    return EngineLimits(max_model_len=engine.max_context_tokens, kv_cache_gib=requested)
