"""A measured policy promises nothing that no code enforces: every key it has is read where it takes effect.

`CONSUMERS` names, for each key of the policy schema, the tests that change the key's value and see
its effect (a node refusing to start, a verifier refusing evidence, a client sending to K nodes, ...).
A key added to the schema without such a test fails here. Knobs with a single allowed value are
enforced by the loader itself: any other value is refused with the requirement it would break.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from pathlib import Path

import pytest

from attestation.backends.sim import SimBackend
from attestation.errors import ChainError, CrlError, OcspStaleError, RimChainError
from attestation.verifier import verify, verify_with_report
from enclave.selfcheck import check_node_settings
from enclave.settings import NodeSettings
from policy import AttestationPolicy, AuditPolicy, AuthorizationPolicy, EnginePolicy, RoutingPolicy
from policy.forbidden import KNOBS
from policy.model import TransparencyPolicy
from policy.loader import SCHEMA, parse_policy
from tests.test_attestation_support import code_digest, collect, dev_policy, dev_variant, sim_root_dir  # noqa: F401
from tests.cpu_tee_support import NOW as CRL_NOW
from tests.cpu_tee_support import amd_hierarchy, cpu_policy, intel_hierarchy, snp_evidence, tdx_evidence
from tests.policy_support import filled_strict_text
from tests.test_attestation_backends import CHAIN_2023, REPORT_2023, RIM_TIME, hopper_bundle, rims_2023
from tests.test_security_claims import missing_tests

FORBIDDEN_KNOB_REFUSED = "tests/test_policy_loading.py::test_every_forbidden_knob_value_is_refused_with_its_requirement"

TRANSPARENCY_REFUSALS = "tests/test_transparency_fleet.py::test_the_sdk_refuses_each_transparency_failure_before_sending"
SNP_PIN_REFUSALS = "tests/test_attestation_snp_platform.py::test_each_pin_refuses_evidence_that_does_not_match_it"
CONSUMERS: dict[str, tuple[str, ...]] = {
    "policy.name": ("tests/test_policy_digest.py::test_every_semantic_change_changes_the_digest",),
    "policy.format": ("tests/test_policy_loading.py::test_invalid_values_are_refused",),
    "attestation.pinned_roots": ("tests/test_attestation_nvidia_vectors.py::test_a_chain_to_an_unpinned_root_is_refused",),
    "attestation.trust_local_simulated_root": (
        "tests/test_policy_consumers.py::test_without_trusting_the_local_root_simulated_evidence_has_no_chain",),
    "attestation.allow_simulated": (
        "tests/test_attestation_cli.py::test_the_same_bundle_under_strict_fails_at_the_simulated_check",
        "tests/test_enclave_node.py::test_self_check_refuses_simulation_under_strict"),
    "attestation.allowed_code_digests": (
        "tests/test_attestation_cli.py::test_measure_gives_the_digests_an_operator_pins_and_evidence_then_verifies_against_them",),
    "attestation.accept_unlisted_code": (
        "tests/test_enclave_node.py::test_a_node_whose_own_evidence_fails_its_policy_refuses_to_start",),
    "attestation.max_evidence_age_s": ("tests/test_attestation_tamper.py::test_tampered_evidence_is_refused_by_the_intended_check",),
    "attestation.max_clock_skew_s": ("tests/test_attestation_tamper.py::test_tampered_evidence_is_refused_by_the_intended_check",),
    "attestation.required_confidential_mode": (
        "tests/test_attestation_backends.py::test_cpu_only_evidence_fails_a_policy_that_requires_the_gpu",),
    "attestation.pinned_rim_roots": (
        "tests/test_attestation_rim.py::test_an_unpinned_rim_root_is_refused",
        "tests/test_policy_consumers.py::test_genuine_rims_verify_only_under_a_policy_pinning_their_root"),
    "attestation.max_ocsp_age_s": (
        "tests/test_policy_consumers.py::test_the_policy_bounds_the_age_of_stapled_revocation_status",),
    "attestation.max_crl_age_s": ("tests/test_policy_consumers.py::test_the_policy_bounds_the_age_of_stapled_crls",),
    "attestation.max_root_crl_age_s": ("tests/test_policy_consumers.py::test_the_policy_bounds_the_age_of_a_roots_own_crl",),
    "attestation.launch_measurements": (
        "tests/test_attestation_sev_snp.py::test_a_launch_measurement_listed_for_other_code_is_refused",),
    "attestation.debug_forbidden": ("tests/test_policy_loading.py::test_debug_cannot_be_allowed",),
    # No check is left to waive: any name is refused by the loader (KNOWN_GAPS is empty).
    "attestation.accepted_gaps": ("tests/test_policy_launch.py::test_strict_accepts_no_cpu_gap_and_lists_no_launch_measurement_yet",),
    "engine.max_context_tokens": ("tests/test_policy_consumers.py::test_a_node_serves_the_policys_context_length",),
    "engine.kv_budget_mib": ("tests/test_enclave_node.py::test_self_check_refuses_a_kv_pool_over_the_policy_budget",),
    "engine.prefix_sharing": (
        "tests/test_enclave_node.py::test_a_node_refuses_a_policy_promising_no_prefix_sharing_at_all", FORBIDDEN_KNOB_REFUSED),
    "engine.allowed_model_digests": (
        "tests/test_attestation_cli.py::test_measure_gives_the_digests_an_operator_pins_and_evidence_then_verifies_against_them",),
    "engine.control_tokens_in_content": (
        "tests/test_policy_consumers.py::test_a_node_encodes_control_tokens_in_request_text_only_where_allowed",),
    "engine.accept_unlisted_models": ("tests/test_security_claims.py::test_strict_admits_no_node_until_a_release_is_listed",),
    # Names what a node may run ("none", "ngram" or "draft-model"); a node refuses any other; the rest is refused.
    "engine.speculation": (
        "tests/test_enclave_speculation.py::test_a_node_refuses_speculation_its_policy_does_not_name",
        FORBIDDEN_KNOB_REFUSED),
    "routing.candidates": (
        "tests/test_client_policy.py::test_each_request_is_encrypted_to_the_policys_number_of_candidates",
        "tests/test_client_policy.py::test_a_caller_may_ask_for_fewer_candidates_than_the_policy_never_more"),
    "routing.capacity_weighting": (
        "tests/test_policy_loading.py::test_invalid_values_are_refused",
        "tests/test_client_directory.py::test_a_uniform_pick_among_candidates_lands_on_each_node_with_its_capacity_share"),
    "routing.max_node_capacity": (
        "tests/test_enclave_node.py::test_a_node_declaring_more_capacity_than_its_policy_allows_refuses_to_start",
        "tests/test_client_directory.py::test_an_inflated_capacity_counts_for_no_more_than_the_policys_maximum"),
    "audit.schema_version": ("tests/test_enclave_node.py::test_a_node_refuses_a_policy_whose_audit_schema_it_does_not_emit",),
    "audit.sink": (
        "tests/test_enclave_node.py::test_a_node_audits_to_the_sink_its_policy_names_unless_the_operator_overrides_it",
        "tests/test_audit_sink.py::test_every_shipped_policys_sink_is_a_form_open_sink_accepts"),
    "authorization.issuer_name": (
        "tests/test_gateway_tokens.py::test_a_bad_token_gets_401_with_the_challenge_and_reaches_no_node",
        "tests/test_policy_loading.py::test_authorization_keys_need_an_issuer_name"),
    "authorization.issuer_keys": (
        "tests/test_gateway_tokens.py::test_a_bad_token_gets_401_with_the_challenge_and_reaches_no_node",
        "tests/test_gateway_tokens.py::test_the_dev_policy_admits_without_a_token"),
    "transparency.required": (
        "tests/test_transparency_fleet.py::test_a_client_under_a_policy_not_requiring_transparency_says_so",
        "tests/test_transparency_fleet.py::test_a_policy_requiring_transparency_without_a_log_admits_no_node"),
    "transparency.log_key": (TRANSPARENCY_REFUSALS,),
    "transparency.witnesses": (TRANSPARENCY_REFUSALS,),
    "transparency.quorum": (TRANSPARENCY_REFUSALS,),
    "transparency.max_checkpoint_age_s": (TRANSPARENCY_REFUSALS,),
    "attestation.tdx_accepted_tcb_statuses": (
        "tests/test_attestation_tdx_collateral.py::test_a_platform_status_strict_refuses_is_named_with_its_advisories",
        "tests/test_attestation_tdx_collateral.py::test_sw_hardening_passes_only_with_every_advisory_the_policy_names"),
    "attestation.tdx_accepted_advisories": ("tests/test_attestation_tdx_collateral.py::test_sw_hardening_passes_only_with_every_advisory_the_policy_names",),
    "attestation.tdx_max_collateral_age_s": ("tests/test_attestation_tdx_collateral.py::test_bad_synthetic_collateral_is_refused_by_its_own_class",),
    "attestation.tdx_min_tcb_evaluation_data_number": (
        "tests/test_attestation_tdx_collateral.py::test_bad_synthetic_collateral_is_refused_by_its_own_class",),
    "attestation.tdx_fmspcs": ("tests/test_attestation_tdx_collateral.py::test_each_tdx_pin_refuses_evidence_it_does_not_match_by_its_own_class",),
    "attestation.tdx_mr_seams": ("tests/test_attestation_tdx_collateral.py::test_each_tdx_pin_refuses_evidence_it_does_not_match_by_its_own_class",),
    "attestation.tdx_mr_config_id": ("tests/test_attestation_tdx_collateral.py::test_each_tdx_pin_refuses_evidence_it_does_not_match_by_its_own_class",),
    "attestation.tdx_mr_owner": ("tests/test_attestation_tdx_collateral.py::test_each_tdx_pin_refuses_evidence_it_does_not_match_by_its_own_class",),
    "attestation.tdx_mr_owner_config": ("tests/test_attestation_tdx_collateral.py::test_each_tdx_pin_refuses_evidence_it_does_not_match_by_its_own_class",),
    "attestation.tdx_min_tee_tcb_svn": ("tests/test_attestation_tdx_collateral.py::test_each_tdx_pin_refuses_evidence_it_does_not_match_by_its_own_class",),
    "attestation.tdx_qe_vendor_id": ("tests/test_attestation_tdx_collateral.py::test_each_tdx_pin_refuses_evidence_it_does_not_match_by_its_own_class",),
    "attestation.sev_snp_min_tcb": (
        "tests/test_attestation_snp_platform.py::test_an_spl_below_the_minimum_is_refused_by_the_revocation_check",
        "tests/test_attestation_snp_platform.py::test_the_genuine_report_is_refused_under_a_minimum_above_it"),
    "attestation.sev_snp_host_data": (SNP_PIN_REFUSALS,),
    "attestation.sev_snp_id_key_digests": (SNP_PIN_REFUSALS,),
    "attestation.sev_snp_author_key_digests": (SNP_PIN_REFUSALS,),
}


def _schema_keys() -> set[str]:
    return {f"{section}.{key}" for section, keys in SCHEMA.items() for key in keys} | \
        {f"{knob.section}.{knob.key}" for knob in KNOBS}


def _single_valued_knobs() -> set[str]:
    return {f"{knob.section}.{knob.key}" for knob in KNOBS if len(knob.allowed) == 1}


def test_every_policy_key_names_the_tests_that_see_its_effect() -> None:
    unnamed = _schema_keys() - _single_valued_knobs() - set(CONSUMERS)
    assert not unnamed, f"policy keys that nothing is shown to read: {sorted(unnamed)}"
    assert set(CONSUMERS) <= _schema_keys(), "CONSUMERS names a key the schema does not have"
    citations = " ".join(f"`{test}`" for tests in CONSUMERS.values() for test in tests)
    assert missing_tests(citations) == []


def test_single_valued_knobs_are_enforced_by_the_loader() -> None:
    assert FORBIDDEN_KNOB_REFUSED.split("::")[1] in Path(__file__).with_name("test_policy_loading.py").read_text()
    assert _single_valued_knobs() == {"engine.kv_offload", "engine.kv_replication", "engine.kv_migration",
                                      "engine.scheduling", "routing.strategy", "audit.profiling"}


def test_the_policy_model_has_no_field_outside_the_schema() -> None:
    sections = {"attestation": AttestationPolicy, "engine": EnginePolicy, "routing": RoutingPolicy, "audit": AuditPolicy,
                "authorization": AuthorizationPolicy, "transparency": TransparencyPolicy}
    fields = {f"{name}.{field.name}" for name, section in sections.items() for field in dataclasses.fields(section)}
    assert fields | {"policy.name", "policy.format"} == _schema_keys()


def test_a_node_serves_the_policys_context_length(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    settings = NodeSettings(model=tmp_path, policy="dev", attestation="sim", kv_cache_gib=0.05)
    for tokens in (512, 2048):
        policy = dev_variant("max_context_tokens = 4096", f"max_context_tokens = {tokens}")
        assert check_node_settings(settings, policy, b"\0" * 32).max_model_len == tokens


def test_a_node_encodes_control_tokens_in_request_text_only_where_allowed() -> None:
    from enclave.node import request_tokenizer
    from tests.family_support import family_folder

    settings = NodeSettings(model=family_folder("qwen3-0.6b"), policy="dev", attestation="sim")
    for allowed in (False, True):
        policy = dev_variant("control_tokens_in_content = false", f"control_tokens_in_content = {str(allowed).lower()}")
        tokenizer = request_tokenizer(settings, policy)
        assert (tokenizer.token_id("<|im_end|>") in tokenizer.encode_prompt("a <|im_end|> b")) is allowed


def test_without_trusting_the_local_root_simulated_evidence_has_no_chain(code_digest: bytes) -> None:  # noqa: F811
    bundle = collect(SimBackend(), dev_policy(), code_digest)
    verify(bundle, dev_policy(), expected_nonce=None)
    untrusting = dev_variant("trust_local_simulated_root = true", "trust_local_simulated_root = false")
    with pytest.raises(ChainError):
        verify(bundle, untrusting)


def test_the_policy_bounds_the_age_of_stapled_revocation_status(code_digest: bytes) -> None:  # noqa: F811
    later = time.time() + 600  # the evidence is still fresh (max_evidence_age_s is an hour)
    verify(collect(SimBackend(), dev_policy(), code_digest), dev_policy(), now=later)
    strict_revocation = dev_variant("max_ocsp_age_s = 86400", "max_ocsp_age_s = 60")
    with pytest.raises(OcspStaleError):
        verify(collect(SimBackend(), strict_revocation, code_digest), strict_revocation, now=later)


def test_genuine_rims_verify_only_under_a_policy_pinning_their_root() -> None:
    strict = filled_strict_text()
    pinned = strict.split("pinned_rim_roots = ", 1)[1].split("\n", 1)[0]
    for text, passes in ((strict, True), (strict.replace(pinned, '["' + "00" * 32 + '"]'), False)):
        policy = parse_policy(text)
        bundle = hopper_bundle(policy, REPORT_2023, CHAIN_2023, rims_2023())
        report = verify_with_report(bundle, policy, chain_time=RIM_TIME)
        check = {check.name: check for check in report.checks}["reference measurements"]
        assert check.passed is passes
    assert isinstance(report.error, RimChainError)


def test_the_policy_bounds_the_age_of_stapled_crls() -> None:
    # max_crl_age_s: the CRL of a CA below the root (Intel's PCK CA), whatever the root's limit.
    crls = intel_hierarchy().crls(pck={"this_update": CRL_NOW - dt.timedelta(days=2)})
    for max_age_s, passes in ((30 * 86_400, True), (86_400, False)):
        policy = cpu_policy(max_crl_age_s=max_age_s, max_root_crl_age_s=400 * 86_400)
        report = verify_with_report(tdx_evidence(policy, crls=crls), policy)
        assert (report.error is None) is passes, report.error
    assert isinstance(report.error, CrlError) and "attestation.max_crl_age_s" in str(report.error)


def test_the_policy_bounds_the_age_of_a_roots_own_crl() -> None:
    # max_root_crl_age_s: the CRL a root signs (AMD's ARK here), whatever the limit below the root.
    crls = amd_hierarchy().crls(this_update=CRL_NOW - dt.timedelta(days=2))
    for max_age_s, passes in ((30 * 86_400, True), (86_400, False)):
        policy = cpu_policy(max_crl_age_s=3600, max_root_crl_age_s=max_age_s)
        report = verify_with_report(snp_evidence(policy, crls=crls), policy)
        assert (report.error is None) is passes, report.error
    assert isinstance(report.error, CrlError) and "attestation.max_root_crl_age_s" in str(report.error)
