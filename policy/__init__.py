"""Veil's measured policy: the rules a node proves it runs under.

A policy is a TOML file with four sections:

- ``[attestation]``: the roots pinned by SHA-256 fingerprint, the code digests
  allowed and the CPU launch measurement each runs in (``launch_measurements``),
  the maximum evidence age, clock skew and CRL age, the confidential modes
  required (``cpu``, ``gpu``), debugging forbidden, whether simulated evidence
  is acceptable, and the verification gaps the policy knowingly accepts
  (``accepted_gaps``; none is left), the roots that sign NVIDIA's RIMs
  (``pinned_rim_roots``), the oldest stapled OCSP response and CRL accepted
  (``max_ocsp_age_s``; ``max_crl_age_s`` below the root, ``max_root_crl_age_s`` for a root's own CRL,
  which roots reissue rarely), and the SEV-SNP floor and pins: the minimum TCB per
  product line (``sev_snp_min_tcb``), HOST_DATA and the ID block's key digests.
- ``[engine]``: maximum context, KV budget, prefix sharing (``request`` or
  ``off``: nothing is shared across requests), the model weights allowed by
  digest, whether text users send may spell control tokens
  (``control_tokens_in_content``; false: it is encoded as text), and the knobs
  of forbidden optimizations, fixed to their safe value.
- ``[routing]``: the number K of candidates a client encrypts each request to
  (a client may ask for fewer, never more: the gateway chooses among them),
  capacity weighting (``true`` only: clients draw in proportion to capacity),
  the most capacity any node may declare (nodes refuse to start above it,
  gateways refuse to admit and clients refuse to count more), and the only
  strategy, uniform random.
- ``[audit]``: the event schema version (a node emitting another refuses to
  start) and the sink a node audits to unless its operator names another.

Every key is read where it takes effect; tests/test_policy_consumers.py names
the tests that change each one and see the effect.

Loading is strict: unknown keys and sections are errors, every required key
must be present, and every optimization ARCHITECTURE.md forbids is refused
with :class:`ForbiddenOptimizationError` naming the requirement it would break
(stateless computation, non-targetability, no privileged runtime access).

The policy's digest is SHA-256 over a canonical encoding (sorted compact JSON
of the validated values), so reformatting a file keeps its digest and any
change of meaning changes it. The digest is part of a node's attested
measurement: clients verify which policy governs a node.

Shipped policies: ``strict`` (production: NVIDIA's, AMD's and Intel's roots
pinned, simulated evidence refused; it ships its transparency log's and
witnesses' keys empty, and refuses to load with :class:`PlaceholderError`,
naming each, until its operator fills them) and ``dev`` (DEVELOPMENT ONLY: accepts simulated
evidence from this machine's simulated root and any code or model digest).
"""

from policy.errors import (
    ForbiddenOptimizationError,
    InvalidValueError,
    MissingKeyError,
    PlaceholderError,
    PolicyError,
    PolicySyntaxError,
    UnknownKeyError,
    UnknownPolicyError,
    WeakenedGuaranteeError,
)
from policy.loader import load_policy, parse_policy
from policy.model import AttestationPolicy, AuditPolicy, AuthorizationPolicy, EnginePolicy, Policy, RoutingPolicy
from policy.shipped import resolve_policy, shipped_policy, shipped_policy_path

__all__ = [
    "AttestationPolicy",
    "AuditPolicy",
    "AuthorizationPolicy",
    "EnginePolicy",
    "ForbiddenOptimizationError",
    "InvalidValueError",
    "MissingKeyError",
    "PlaceholderError",
    "Policy",
    "PolicyError",
    "PolicySyntaxError",
    "RoutingPolicy",
    "UnknownKeyError",
    "UnknownPolicyError",
    "WeakenedGuaranteeError",
    "load_policy",
    "parse_policy",
    "resolve_policy",
    "shipped_policy",
    "shipped_policy_path",
]
