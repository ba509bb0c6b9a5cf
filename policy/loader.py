"""Reading a policy file: strict TOML, every key known, every forbidden optimization refused."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from policy import fields
from policy.canonical import canonical_encoding, digest_of
from policy.errors import InvalidValueError, MissingKeyError, PolicySyntaxError, UnknownKeyError
from policy.forbidden import check_knob, knobs_of, refuse_alias
from policy.model import (
    CONFIDENTIAL_PARTS,
    KNOWN_GAPS,
    AttestationPolicy,
    AuditPolicy,
    AuthorizationPolicy,
    EnginePolicy,
    Policy,
    RoutingPolicy,
    TransparencyPolicy,
)
from policy.placeholders import check_placeholders
from protocol.constants import MAX_CANDIDATES

# Required keys of each section and how to read them. Keys of forbidden-optimization
# knobs (policy.forbidden.KNOBS) are optional and default to their safe value.
SCHEMA: dict[str, dict[str, fields.Reader]] = {
    "policy": {"name": fields.name, "format": fields.integer(1, 1)},
    "attestation": {
        "pinned_roots": fields.digest_set,
        "pinned_rim_roots": fields.digest_set,
        "trust_local_simulated_root": fields.boolean,
        "allow_simulated": fields.boolean,
        "allowed_code_digests": fields.digest_set,
        "accept_unlisted_code": fields.boolean,
        "max_evidence_age_s": fields.integer(1, 86_400),
        "max_clock_skew_s": fields.integer(0, 300),
        "max_ocsp_age_s": fields.integer(60, 7 * 86_400),
        "max_crl_age_s": fields.integer(3600, 400 * 86_400),
        # A root's own CRL: Intel's SGX Root CA reissues its CRL about yearly (SECURITY.md, "Revocation").
        "max_root_crl_age_s": fields.integer(3600, 400 * 86_400),
        "launch_measurements": fields.launch_references,
        "required_confidential_mode": fields.subset_of(*CONFIDENTIAL_PARTS),
        "debug_forbidden": fields.boolean,
        "accepted_gaps": fields.subset_of(*KNOWN_GAPS),
        # SEV-SNP platform floor and pins (attestation.snp_platform); each empty list compares nothing.
        "sev_snp_min_tcb": fields.snp_tcb_minimums,
        "sev_snp_host_data": fields.hex_set(32, "32-byte HOST_DATA values"),
        "sev_snp_id_key_digests": fields.hex_set(48, "SHA-384 key digests"),
        "sev_snp_author_key_digests": fields.hex_set(48, "SHA-384 key digests"),
        # Intel TDX collateral and pins (attestation.tdx_tcb); an empty pin compares nothing.
        "tdx_accepted_tcb_statuses": fields.tdx_statuses,
        "tdx_accepted_advisories": fields.advisory_ids,
        "tdx_max_collateral_age_s": fields.integer(3600, 90 * 86_400),
        "tdx_min_tcb_evaluation_data_number": fields.integer(0, 1 << 16),
        "tdx_fmspcs": fields.hex_set(6, "FMSPC values"),
        "tdx_mr_seams": fields.hex_set(48, "TDX module measurements (MRSEAM)"),
        "tdx_mr_config_id": fields.optional_hex(48, "MRCONFIGID"),
        "tdx_mr_owner": fields.optional_hex(48, "MROWNER"),
        "tdx_mr_owner_config": fields.optional_hex(48, "MROWNERCONFIG"),
        "tdx_min_tee_tcb_svn": fields.optional_hex(16, "TEE_TCB_SVN"),
        "tdx_qe_vendor_id": fields.optional_hex(16, "QE vendor id"),
    },
    "engine": {
        "max_context_tokens": fields.integer(1, 1 << 20),
        "kv_budget_mib": fields.integer(1, 1 << 20),
        "allowed_model_digests": fields.digest_set,
        "accept_unlisted_models": fields.boolean,
        # true: text in messages and prompts that spells a control token (`<|eot_id|>`) is that token.
        "control_tokens_in_content": fields.boolean,
    },
    "routing": {
        # The most nodes a client encrypts one request to; no more than the gateway accepts.
        "candidates": fields.integer(1, MAX_CANDIDATES),
        "capacity_weighting": fields.only_true(
            "clients always draw candidates in proportion to capacity, which is what bounds any "
            "node's share of requests to its capacity share"),
        "max_node_capacity": fields.integer(1, 1 << 16),
    },
    "audit": {
        # Nodes refuse to start unless it is the version of the events they emit (enclave/selfcheck.py).
        "schema_version": fields.integer(1, 1 << 16),
        "sink": fields.audit_sink,
    },
    "authorization": {"issuer_name": fields.host_name, "issuer_keys": fields.digest_set},
    "transparency": {
        "required": fields.boolean,
        "log_key": fields.note_key,
        "witnesses": fields.witness_keys,
        "quorum": fields.integer(0, 64),
        "max_checkpoint_age_s": fields.integer(60, 30 * 86_400),
    },
}


def load_policy(path: str | Path) -> Policy:
    """Load, validate and digest the policy file at `path`; raise a PolicyError subclass on any fault."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as error:
        raise PolicySyntaxError(f"cannot read policy file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise PolicySyntaxError(f"policy file {path} is not UTF-8 text") from None
    return parse_policy(text)


def parse_policy(text: str) -> Policy:
    """Validate and digest a policy given as TOML text."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise PolicySyntaxError(f"policy is not valid TOML: {error}") from None
    sections = {section: _read_section(document, section) for section in SCHEMA}
    _reject_unknown_sections(document)
    policy = _assemble(sections)
    _check_consistency(policy)
    check_placeholders(policy.name, document["transparency"], policy.transparency)
    return policy


def _read_section(document: dict[str, Any], section: str) -> dict[str, Any]:
    table = document.get(section)
    if not isinstance(table, dict):
        raise MissingKeyError(f"policy has no [{section}] section; add it")
    knobs = knobs_of(section)
    for key in table:
        refuse_alias(section, key)
        if key not in SCHEMA[section] and key not in knobs:
            raise UnknownKeyError(f"{section}.{key} is not a policy key; remove or correct it")
    values = {}
    for key, read in SCHEMA[section].items():
        if key not in table:
            raise MissingKeyError(f"{section}.{key} is required")
        values[key] = read(f"{section}.{key}", table[key])
    for key, knob in knobs.items():
        values[key] = check_knob(knob, table.get(key, knob.default))
    return values


def _reject_unknown_sections(document: dict[str, Any]) -> None:
    for section in document:
        if section not in SCHEMA:
            raise UnknownKeyError(f"[{section}] is not a policy section; remove or correct it")


def _assemble(sections: dict[str, dict[str, Any]]) -> Policy:
    parts = {
        "name": sections["policy"]["name"],
        "attestation": AttestationPolicy(**sections["attestation"]),
        "engine": EnginePolicy(**sections["engine"]),
        "routing": RoutingPolicy(**sections["routing"]),
        "audit": AuditPolicy(**sections["audit"]),
        "authorization": AuthorizationPolicy(**sections["authorization"]),
        "transparency": TransparencyPolicy(**sections["transparency"]),
    }
    draft = Policy(digest=b"", **parts)
    return Policy(digest=digest_of(canonical_encoding(draft)), **parts)


def _check_consistency(policy: Policy) -> None:
    from policy.guarantees import check_guarantees

    check_guarantees(policy)
    attestation = policy.attestation
    if policy.authorization.issuer_keys and not policy.authorization.issuer_name:
        raise InvalidValueError("authorization.issuer_keys needs authorization.issuer_name: the issuer tokens name")
    if not attestation.pinned_roots and not attestation.trust_local_simulated_root:
        raise InvalidValueError("attestation.pinned_roots is empty: pin at least one root certificate")
    dev_only = {
        "attestation.trust_local_simulated_root": attestation.trust_local_simulated_root,
        "attestation.accept_unlisted_code": attestation.accept_unlisted_code,
        "engine.accept_unlisted_models": policy.engine.accept_unlisted_models,
        "transparency.required = false": not policy.transparency.required,
    }
    unlisted = {ref.code_digest for ref in attestation.launch_measurements} - set(attestation.allowed_code_digests)
    if unlisted:
        raise InvalidValueError(
            "attestation.launch_measurements names a code digest that allowed_code_digests does not list; "
            "list it there too, or remove the launch measurement"
        )
    _check_transparency(policy.transparency)
    for where, enabled in dev_only.items():
        if enabled and not attestation.allow_simulated:
            raise InvalidValueError(
                f"{where} is a development setting: it needs attestation.allow_simulated = true, "
                "and a production policy must not set it"
            )


def _check_transparency(transparency: TransparencyPolicy) -> None:
    if transparency.quorum > len(transparency.witnesses):
        raise InvalidValueError("transparency.quorum is larger than the number of transparency.witnesses")
    if transparency.required and transparency.quorum == 0:
        # Only cosignatures carry a time, and only witnesses show that every client sees one history.
        raise InvalidValueError("transparency.quorum = 0 with transparency.required = true trusts the log's signature "
                                "alone: nothing shows that other clients see the same log, nor how old a checkpoint "
                                "is; list the witnesses and a quorum of at least 1")
