"""What a node checks before it serves: the policy it runs under allows this configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from audit.events import SCHEMA_VERSION
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
    _check_prefix_sharing(engine.prefix_sharing)
    _check_speculation(settings.speculative, policy)
    _check_task(settings)
    _check_audit_schema(policy)
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
    utilization = settings.gpu_memory_utilization
    if utilization is not None and not 0 < utilization <= 1:
        raise SelfCheckError("--gpu-memory-utilization must be a fraction above 0 and at most 1")
    if settings.max_num_seqs is not None and settings.max_num_seqs < settings.capacity:
        raise SelfCheckError("--max-num-seqs must be at least --capacity: the engine must batch every request the "
                             "node admits")
    return EngineLimits(max_model_len=_max_model_len(settings, policy), kv_cache_gib=requested)


def _check_task(settings: NodeSettings) -> None:
    """A setting for another task would be ignored, and the operator would believe it applied."""
    if settings.pooling is not None and settings.task != "embed":
        raise SelfCheckError(f"--pooling applies to --task embed only, and this node's task is {settings.task}: "
                             "drop --pooling, or add --task embed to serve embeddings")


def _check_speculation(speculative: str | None, policy: Policy) -> None:
    """A node runs only the speculation its measured policy names, so a client's verifier sees what runs."""
    if speculative is None:
        return
    kind = "draft-model" if speculative.startswith("draft:") else speculative
    if kind != policy.engine.speculation:
        raise SelfCheckError(
            f"--speculative {kind if kind != 'draft-model' else 'draft:DIR'} needs policy {policy.name!r} to name it "
            f"(engine.speculation = {kind!r}); it names {policy.engine.speculation!r}"
        )


def _max_model_len(settings: NodeSettings, policy: Policy) -> int:
    """The node's context limit: the policy's, or a smaller one the operator asked for (never a larger one)."""
    most = policy.engine.max_context_tokens
    if settings.max_model_len is None:
        return most
    if not 1 <= settings.max_model_len <= most:
        raise SelfCheckError(f"--max-model-len must be between 1 and policy {policy.name!r}'s "
                             f"engine.max_context_tokens, {most}")
    return settings.max_model_len


def emitted_schema_version() -> int:
    """The version number of the audit events this node emits ("veil.audit/1" is 1)."""
    return int(SCHEMA_VERSION.rsplit("/", 1)[1])


def _check_prefix_sharing(prefix_sharing: str) -> None:
    if prefix_sharing == "off":
        # The engine computes a prompt once for a request's n samples and shares its blocks among
        # them: a policy promising no sharing at all is a promise this node cannot keep.
        raise SelfCheckError(
            "engine.prefix_sharing = \"off\" cannot be honoured: the engine shares a prompt's blocks "
            "among one request's samples; run under prefix_sharing = \"request\""
        )
    if prefix_sharing != "request":
        raise SelfCheckError("prefix sharing beyond one request breaks stateless computation")


def _check_audit_schema(policy: Policy) -> None:
    emitted = emitted_schema_version()
    if policy.audit.schema_version != emitted:
        raise SelfCheckError(
            f"policy {policy.name!r} requires audit schema version {policy.audit.schema_version}, but this "
            f"node emits {SCHEMA_VERSION}; run a release that emits that version or correct the policy"
        )
