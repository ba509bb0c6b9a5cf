"""The policy as data: one frozen dataclass per section of the policy file."""

from __future__ import annotations

from dataclasses import dataclass

# Checks the offline verifier cannot perform yet. A policy accepts evidence
# that depends on one only by naming it in `attestation.accepted_gaps`, so the
# gap is written in the measured policy instead of being hidden in code.
KNOWN_GAPS: tuple[str, ...] = ()  # none left: every check runs offline

CONFIDENTIAL_PARTS: tuple[str, ...] = ("cpu", "gpu")
LAUNCH_TEES: tuple[str, ...] = ("sev-snp", "tdx")
# Intel's TCB statuses a policy may accept (TCB Info v3); "Revoked" is not among them.
TDX_TCB_STATUSES: tuple[str, ...] = ("UpToDate", "SWHardeningNeeded", "ConfigurationNeeded",
                                     "ConfigurationAndSWHardeningNeeded", "OutOfDate", "OutOfDateConfigurationNeeded")


@dataclass(frozen=True, slots=True)
class LaunchReference:
    """A released VM image's CPU launch measurement, and the code digest it runs.

    SEV-SNP: `measurement` is MEASUREMENT. TDX: `measurement` is MRTD, and `rtmrs`
    holds RTMR0-3 where the release fixes them (None: not compared). All hex.
    """

    tee: str  # one of LAUNCH_TEES
    code_digest: str  # SHA-256 hex, also listed in allowed_code_digests
    measurement: str  # 48 bytes, hex
    rtmrs: tuple[str | None, str | None, str | None, str | None] = (None, None, None, None)


SNP_PRODUCTS: tuple[str, ...] = ("Genoa", "Milan", "Turin")


@dataclass(frozen=True, slots=True)
class SnpTcbMinimum:
    """The lowest SEV-SNP security patch level (SPL) accepted per TCB component, for one product line.

    `fmc` exists on Turin and later only (None before). Levels come from AMD's TCB recovery events
    (security bulletins): a platform below one runs firmware or microcode AMD has published flaws in.
    """

    product: str  # one of SNP_PRODUCTS, as the VCEK's productName names it
    boot_loader: int
    tee: int
    snp: int
    microcode: int
    fmc: int | None = None


@dataclass(frozen=True, slots=True)
class AttestationPolicy:
    """What evidence a verifier accepts."""

    pinned_roots: tuple[str, ...]  # SHA-256 fingerprints (hex) of root certificates
    pinned_rim_roots: tuple[str, ...]  # SHA-256 fingerprints of roots that sign NVIDIA's RIMs
    trust_local_simulated_root: bool  # development: trust this machine's simulated root CA
    allow_simulated: bool
    allowed_code_digests: tuple[str, ...]
    accept_unlisted_code: bool  # development: any code digest passes, labelled as such
    max_evidence_age_s: int
    max_clock_skew_s: int
    max_ocsp_age_s: int  # oldest acceptable revocation status (OCSP thisUpdate)
    max_crl_age_s: int  # oldest acceptable stapled CRL of a CA below the root (seconds since its thisUpdate)
    max_root_crl_age_s: int  # the same for a root CA's own CRL, which roots reissue rarely (Intel: yearly)
    launch_measurements: tuple[LaunchReference, ...]  # the code digest passes on hardware only with one of these
    required_confidential_mode: tuple[str, ...]  # subset of CONFIDENTIAL_PARTS
    debug_forbidden: bool
    accepted_gaps: tuple[str, ...]  # subset of KNOWN_GAPS
    # SEV-SNP floor and pins, each optional (empty: not compared). A product whose VCEK names no
    # minimum here is refused while any minimum is listed.
    sev_snp_min_tcb: tuple[SnpTcbMinimum, ...]  # sorted by product
    sev_snp_host_data: tuple[str, ...]  # HOST_DATA values accepted (32 bytes, hex)
    sev_snp_id_key_digests: tuple[str, ...]  # ID_KEY_DIGEST values accepted (SHA-384, hex)
    sev_snp_author_key_digests: tuple[str, ...]  # AUTHOR_KEY_DIGEST values accepted (SHA-384, hex)
    # Intel TDX: what Intel's stapled collateral must say (attestation.tdx_tcb), and optional pins
    # (empty: not compared). Statuses are Intel's tcbStatus names; Revoked is never accepted.
    tdx_accepted_tcb_statuses: tuple[str, ...]  # subset of TDX_TCB_STATUSES, UpToDate among them
    tdx_accepted_advisories: tuple[str, ...]  # INTEL-SA ids a status other than UpToDate may name
    tdx_max_collateral_age_s: int  # oldest TCB Info / QE Identity accepted (seconds since issueDate)
    tdx_min_tcb_evaluation_data_number: int  # the TCB recovery the collateral must include
    tdx_fmspcs: tuple[str, ...]  # platform models (FMSPC, 6 bytes hex) accepted
    tdx_mr_seams: tuple[str, ...]  # TDX module measurements (MRSEAM, 48 bytes hex) accepted
    tdx_mr_config_id: str  # 48 bytes hex, or ""
    tdx_mr_owner: str  # 48 bytes hex, or ""
    tdx_mr_owner_config: str  # 48 bytes hex, or ""
    tdx_min_tee_tcb_svn: str  # 16 bytes hex, each a floor for that TEE_TCB_SVN component, or ""
    tdx_qe_vendor_id: str  # 16 bytes hex, or ""


@dataclass(frozen=True, slots=True)
class EnginePolicy:
    """Limits and the only shapes of state the engine may keep."""

    max_context_tokens: int
    kv_budget_mib: int
    prefix_sharing: str  # "request" or "off"
    allowed_model_digests: tuple[str, ...]
    accept_unlisted_models: bool  # development: any weights pass, labelled as such
    # Whether users may write control tokens: false, a request's text is encoded as text, so a pasted
    # `<|im_end|>` cannot end its turn; only the chat template writes control tokens.
    control_tokens_in_content: bool
    kv_offload: str
    kv_replication: str
    kv_migration: str
    scheduling: str
    speculation: str


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """How clients and the gateway pick a node."""

    candidates: int  # K: encapsulations per request
    capacity_weighting: bool
    # The most concurrent requests a node may declare. Nodes refuse to start above it and clients
    # count no node above it, so nobody can inflate a node's capacity to draw more users to it.
    max_node_capacity: int
    strategy: str


@dataclass(frozen=True, slots=True)
class AuditPolicy:
    """What leaves a node besides answers."""

    schema_version: int
    sink: str  # "stderr" or "jsonl:<path>"
    profiling: str


@dataclass(frozen=True, slots=True)
class AuthorizationPolicy:
    """Which anonymous tokens the gateway accepts (Privacy Pass, RFC 9578 type 2); no keys: everyone is admitted."""

    issuer_name: str  # the issuer's host name that token challenges name ("" when no keys are listed)
    # SHA-256 token key ids of the issuer keys whose tokens are accepted. Listing them here puts them
    # in the measured policy: an issuer cannot hand one user a key of their own unnoticed.
    issuer_keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class WitnessKey:
    """A witness the client trusts: its name and its cosignature/v1 verifier key (C2SP note key)."""

    name: str
    key: str


@dataclass(frozen=True, slots=True)
class TransparencyPolicy:
    """Whether a node's release and key must be in a witnessed log, and which log and witnesses count.

    The keys are C2SP note verifier keys; `attestation.transparency.requirement` reads them in the
    c2sp.org/tlog-policy shape (one log, the witnesses, a group of `quorum` of them). A key "" is a
    placeholder: a policy requiring transparency, or naming part of it, loads only once every key is filled
    (policy/placeholders.py), since no node could pass before.
    """

    required: bool
    log_key: str  # the log's Ed25519 note verifier key, "" while none is named
    witnesses: tuple[WitnessKey, ...]  # sorted by name; a key "" is a placeholder, refused at load where it counts
    quorum: int  # how many of `witnesses` must cosign a checkpoint; at least 1 where required
    max_checkpoint_age_s: int  # the quorum's cosignatures must be at most this old


@dataclass(frozen=True, slots=True)
class Policy:
    """A loaded, validated policy and the digest that nodes attest to."""

    name: str
    attestation: AttestationPolicy
    engine: EnginePolicy
    routing: RoutingPolicy
    audit: AuditPolicy
    authorization: AuthorizationPolicy
    transparency: TransparencyPolicy
    digest: bytes  # SHA-256 of policy.canonical.canonical_encoding(policy)

    @property
    def is_development(self) -> bool:
        """True when the policy accepts simulated evidence: never a production policy."""
        return self.attestation.allow_simulated

