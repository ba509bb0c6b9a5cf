"""`veil node`: run one enclave node."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from audit.logs import add_operation_options, configure_logging
from enclave.tool_calls import FORMATS

_log = logging.getLogger("veil.node")

if TYPE_CHECKING:
    from audit.events import ProofFreshness, ProofRefreshOutcome
    from enclave.node import NodeServer
    from enclave.settings import NodeSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    node = subparsers.add_parser("node", help="run an enclave node (gRPC: Attest, Infer, Health)")
    node.add_argument("--model", type=Path, required=True, help="Hugging Face model folder")
    node.add_argument("--policy", default="dev", help="shipped policy name (strict, dev) or a policy file")
    node.add_argument("--attestation", choices=("sim", "nvml", "tsm"), default=None,
                      help="evidence backend (default: probe nvml, then tsm; sim only if the policy allows it)")
    node.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to serve gRPC on (port 0 picks a free one)")
    node.add_argument("--port-file", type=Path, default=None,
                      help="write the chosen port here once serving (default: none, not written)")
    node.add_argument("--capacity", type=int, default=16,
                      help="concurrent requests served (default: 16; at most the policy's max_node_capacity)")
    node.add_argument("--audit", default=None,
                      help="audit sink: stdout, stderr, file:PATH, jsonl:PATH or none (default: the policy's audit.sink)")
    node.add_argument("--key-rotation-s", type=float, default=3600.0, help="HPKE key lifetime (0 = never rotate)")
    node.add_argument("--key-grace-s", type=float, default=300.0, help="how long the previous key still opens requests")
    node.add_argument("--model-name", action="append", default=None, metavar="ID",
                      help="a model id clients ask for; repeat it for aliases (the first is the id answers name; "
                           "/v1/models lists each; default: the folder name)")
    node.add_argument("--task", choices=("generate", "embed"), default="generate",
                      help="what the model serves: generate (chat, completions, responses) or embed (/v1/embeddings "
                           "only; default: %(default)s)")
    node.add_argument("--pooling", choices=("last", "mean"), default=None,
                      help="with --task embed: last-token or mean pooling of the final hidden states (default: what "
                           "the folder's sentence-transformers modules.json states, else last)")
    node.add_argument("--tool-call-format", choices=FORMATS,
                      default=None, help="the tool-call format the model writes, read with tool_choice \"auto\" "
                           "(default: the one its chat template shows; a template that shows none refuses \"auto\")")
    node.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool size on CPU (default: the policy's budget)")
    node.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="the engine's compute dtype (default: the model's own where this device computes it "
                           "natively, else float32)")
    node.add_argument("--eager", action="store_true",
                      help="CUDA: run every engine step eagerly, no decode graphs (default: graphs on CUDA)")
    node.add_argument("--sync-scheduling", action="store_true",
                      help="CUDA: read each step's tokens before launching the next (default: async steps on CUDA)")
    node.add_argument("--bridge-toll-us", type=float, default=0.0,
                      help="simulate a confidential-computing bridge: every host<->device crossing of the engine "
                           "waits this long (default: %(default)s, none)")
    node.add_argument("--drain-s", type=float, default=30.0,
                      help="on SIGTERM, stop admitting and let requests in flight finish for up to this long "
                           "before zeroing and exiting (default: %(default)s)")
    node.add_argument("--evidence-check-s", type=float, default=300.0,
                      help="re-attest this node to itself this often; grpc.health.v1 reads NOT_SERVING once the "
                           "last passing check is two intervals old (default: %(default)s)")
    node.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                      help="serve Prometheus metrics (aggregates of the audit events, nothing else) on HOST:PORT "
                           "(default: none, no metrics port)")
    node.add_argument("--max-model-len", type=int, default=None,
                      help="longest prompt plus output, in tokens (default: the policy's engine.max_context_tokens, "
                           "which it may not exceed)")
    node.add_argument("--gpu-memory-utilization", type=float, default=None,
                      help="CUDA: the fraction of the device memory free after loading the weights that the KV pool "
                           "and decode graphs take (default: the engine's, 0.85)")
    node.add_argument("--max-num-seqs", type=int, default=None,
                      help="sequences the engine batches at once (default: the larger of 64 and --capacity)")
    node.add_argument("--max-num-batched-tokens", type=int, default=None,
                      help="tokens one engine step computes at most (default: the engine's, 1024)")
    node.add_argument("--speculative", default=None, metavar="ngram|draft:DIR",
                      help="speculative decoding: ngram drafts from each request's own tokens, draft:DIR from the "
                           "model in DIR (same tokenizer; measured with the model); the policy's engine.speculation "
                           "must name it (default: none)")
    node.add_argument("--num-speculative-tokens", type=int, default=3,
                      help="drafts verified per sample per step (default: %(default)s)")
    # engine.sampling_draw.DRAWS, spelled out: importing it would load torch to parse a command line.
    node.add_argument("--sampling-draw", choices=("inverse", "race"), default=None,
                      help="how sampled tokens are drawn: inverse (one uniform per sample, through its cumulative "
                           "probabilities) or race (exponential noise per token, which couples a draft model's draws "
                           "with the model's); the same distribution either way, different tokens for a seed "
                           "(default: race with a draft model, else inverse)")
    node.add_argument("--transparency-log", default=None, metavar="URL",
                      help="the operator's transparency log (`veil log serve --key`): log this node's key statement "
                           "at start and at each key rotation, and staple proofs of its release and key to its "
                           "evidence (default: none, no proofs; clients under a policy requiring them refuse it)")
    node.add_argument("--transparency-refresh-s", type=float, default=60.0,
                      help="fetch fresh proofs from the log this often (default: %(default)s)")
    add_operation_options(node)
    node.set_defaults(handler=_run_node)


def node_settings(args: argparse.Namespace) -> NodeSettings:
    from enclave.settings import NodeSettings

    return NodeSettings(
        model=args.model, policy=args.policy, attestation=args.attestation, listen=args.listen,
        port_file=args.port_file, capacity=args.capacity, audit=args.audit, key_rotation_s=args.key_rotation_s,
        key_grace_s=args.key_grace_s, model_name=_first(args.model_name),
        model_aliases=tuple(dict.fromkeys(args.model_name or ()))[1:], kv_cache_gib=args.kv_cache_gib,
        tool_call_format=args.tool_call_format, task=args.task, pooling=args.pooling,
        dtype=args.dtype, cuda_graphs=not args.eager, async_scheduling=not args.sync_scheduling,
        bridge_toll_us=args.bridge_toll_us,
        drain_s=args.drain_s, evidence_check_s=args.evidence_check_s, metrics_listen=args.metrics_listen,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        sampling_draw=args.sampling_draw, transparency_log=args.transparency_log,
        transparency_refresh_s=args.transparency_refresh_s,
    )


def _first(names: list[str] | None) -> str | None:
    return names[0] if names else None


def _run_node(args: argparse.Namespace) -> int:
    from attestation.errors import AttestationError
    from audit.errors import AuditError
    from enclave.errors import NodeError
    from audit.events import ProofFreshness, ProofRefreshOutcome
    from enclave.node import NodeServer
    from enclave.stop_signals import stop_on_signals, wait_until_stopped
    from engine import EngineError
    from policy import PolicyError

    configure_logging(args.log_format)
    settings = node_settings(args)
    # Before the node serves: a SIGTERM from then on drains it (one during start-up drains it at once).
    stopped = stop_on_signals()
    try:
        node = NodeServer(settings)
        node.on_proofs_refreshed = lambda outcome, proofs: _log_proof_refresh(node, outcome, proofs)
        port = node.start()
    except (PolicyError, NodeError, AttestationError, AuditError, EngineError, OSError) as error:
        _log.error("veil node: refusing to start: %s", error)
        return 2
    if node.policy.is_development:
        _log.warning("veil node: policy %r is a DEVELOPMENT policy; this node protects nothing", node.policy.name)
    host = settings.listen.rsplit(":", 1)[0]
    _log.info("veil node: serving on %s:%s (node %s)", host, port, node.node_id[:16])
    if node.metrics_server is not None:
        _log.info("veil node: metrics on %s:%s", settings.metrics_listen.rpartition(":")[0], node.metrics_server.port)
    _report_transparency(node)
    wait_until_stopped(stopped)
    # Drain: health turns NOT_SERVING and new requests are refused (the gateway fails them over), the
    # requests in flight finish within --drain-s; then the engine zeroes their blocks and the node exits.
    _log.info("veil node: draining (up to %g s)", settings.drain_s)
    drained = node.drain(settings.drain_s)
    node.stop(grace=0.0 if drained else 1.0)
    if drained:
        _log.info("veil node: stopped")
    else:
        _log.warning("veil node: stopped; requests still running at --drain-s were ended")
    return 0


def _log_proof_refresh(node: NodeServer, outcome: ProofRefreshOutcome, proofs: ProofFreshness) -> None:
    """A failed refresh of the node's transparency proofs, as a warning; as an error once they near expiry."""
    line = node.stapler.failure_line(outcome, proofs) if node.stapler is not None else None
    if line is not None:
        serious, text = line
        _log.log(logging.ERROR if serious else logging.WARNING, "%s", text)


def _report_transparency(node: NodeServer) -> None:
    """Say whether the node staples log proofs: it logs nothing itself (only typed audit events leave it)."""
    stapler = node.stapler
    if stapler is None:
        _log.info("veil node: no --transparency-log: this node staples no log proofs")
    elif stapler.last_error is not None:
        _log.warning("veil node: the transparency log did not take or prove this node's key (retrying every "
                     "%g s): %s", stapler.refresh_s, stapler.last_error)
    else:
        _log.info("veil node: key statement logged at index %s; proofs stapled to the evidence",
                  stapler.logged_index)
