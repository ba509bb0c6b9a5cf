"""How a node is started: the `veil node` command line as a dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class NodeSettings:
    model: Path
    policy: str = "dev"  # a shipped policy name or a policy file
    attestation: str | None = None  # sim, nvml, tsm; None probes
    listen: str = "127.0.0.1:0"
    port_file: Path | None = None
    capacity: int = 16  # concurrent requests
    audit: str | None = None  # stdout, stderr, file:PATH, jsonl:PATH or none; None: the policy's audit.sink
    key_rotation_s: float = 3600.0
    key_grace_s: float = 300.0
    model_name: str | None = None
    model_aliases: tuple[str, ...] = ()  # more ids the model is asked for by; answers name `model_name`
    # The tool-call format the model writes (`enclave.tool_calls.FORMATS`), for a template that shows none; None: the template's.
    tool_call_format: str | None = None
    # "generate", or "embed": the model serves /v1/embeddings only, pooled as `pooling` says ("last" or
    # "mean"; None: what the folder's sentence-transformers config states, else "last"; `engine.pooling`).
    task: str = "generate"
    pooling: str | None = None
    kv_cache_gib: float | None = None  # default: the policy's KV budget
    dtype: str | None = None  # None: the model's own where the device computes it natively (`engine.compute_dtype`)
    # On CUDA the engine replays decode graphs and launches each step before reading the previous one.
    # Turning either off is an operator's escape hatch; neither changes what is zeroed or audited.
    cuda_graphs: bool = True
    async_scheduling: bool = True
    # A simulated confidential-computing bridge (`engine.bridge`): every host<->device crossing of the
    # engine waits this long, for measuring a node as it would run under CC on hardware without it.
    bridge_toll_us: float = 0.0
    # Drain on SIGTERM: stop admitting, let requests in flight finish for up to this long, then zero and exit.
    drain_s: float = 30.0
    # How often the node re-attests itself (a fresh nonce, verified under its own policy); its health is
    # SERVING only while the last such check passed within two intervals.
    evidence_check_s: float = 300.0
    # Prometheus metrics (audit.metrics) on HOST:PORT; None (the default): no metrics port. A node's metrics
    # port is a surface that leaves the enclave, so it is opened only when the operator asks for it.
    metrics_listen: str | None = None
    # The engine's serving limits (None: the policy's context limit, the engine's own defaults, and at
    # least `capacity` sequences batched).
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # Speculative decoding (`engine.speculative`): "ngram", "draft:DIR" or None; the policy's
    # engine.speculation must name it, and a draft model is measured with the model.
    speculative: str | None = None
    num_speculative_tokens: int = 3
    # How sampled tokens are drawn (`engine.sampling_draw`): "inverse", "race", or None for the engine's
    # default (race with a draft model, whose acceptance it raises; else inverse, the cheaper).
    sampling_draw: str | None = None
    # The operator's transparency log (`veil log serve --key`): the node logs its key statement there and
    # staples proofs of its release and key to its evidence, refreshed every transparency_refresh_s.
    transparency_log: str | None = None
    transparency_refresh_s: float = 60.0

    @property
    def draft_model(self) -> Path | None:
        """The draft model's folder under --speculative draft:DIR, else None."""
        if self.speculative is None or not self.speculative.startswith("draft:"):
            return None
        return Path(self.speculative.removeprefix("draft:"))
