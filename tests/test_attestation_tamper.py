"""The tamper matrix: every corruption of simulated evidence is refused by the check meant to catch it."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest

from attestation import errors
from attestation.backends.sim import SIM_GPU_STATE, SimBackend
from attestation.bundle import EvidenceBundle
from attestation.receipts import ReceiptSigner
from attestation.verifier import CHECK_NAMES, verify, verify_with_report
from tests.policy_support import filled_strict
from tests.test_attestation_support import (  # noqa: F401  (fixtures)
    b64,
    code_digest,
    collect,
    dev_policy,
    dev_variant,
    edit_json,
    flip,
    key_config,
    sim_root_dir,
    unb64,
)


def _gpu_chain(document, change):
    document["gpu"]["cert_chain"] = change(document["gpu"]["cert_chain"])


def _report(document, part, change):
    document[part]["report"] = b64(change(unb64(document[part]["report"])))


def _set(path, value):
    def change(document):
        target = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


# Each case: (name, expected error, how to make the bundle text or object and the policy).
def case_wrong_root(code, tmp_path):
    other = SimBackend(tmp_path / "another-root")  # a simulated root nobody pinned
    return collect(other, dev_policy(), code), dev_policy(), {}


def case_broken_chain(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, lambda d: _gpu_chain(d, lambda chain: [chain[0], chain[2]])), dev_policy(), {}


def case_reordered_chain(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, lambda d: _gpu_chain(d, lambda chain: [chain[1], chain[0], chain[2]])), dev_policy(), {}


def case_corrupted_certificate(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    corrupt = lambda chain: [chain[0], b64(flip(unb64(chain[1]), len(unb64(chain[1])) - 5)), chain[2]]
    return edit_json(bundle, lambda d: _gpu_chain(d, corrupt)), dev_policy(), {}


def case_bad_gpu_signature(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, lambda d: _report(d, "gpu", lambda r: flip(r, len(r) - 1))), dev_policy(), {}


def case_bad_cpu_signature(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, lambda d: _report(d, "cpu", lambda r: flip(r, len(r) - 1))), dev_policy(), {}


def case_gpu_measurement_edited(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, lambda d: _report(d, "gpu", lambda r: flip(r, 37 + 20))), dev_policy(), {}


def case_cpu_debug_bit_edited(code, tmp_path):
    bundle = collect(SimBackend(debug=True), dev_policy(), code)
    return edit_json(bundle, lambda d: _report(d, "cpu", lambda r: flip(r, 8))), dev_policy(), {}


def case_key_config_replaced(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, _set(["key_config"], b64(key_config()))), dev_policy(), {}


def case_receipt_key_replaced(code, tmp_path):
    # A receipt key the attested code never held: receipts signed under it would pass for the node's.
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, _set(["receipt_key"], b64(ReceiptSigner.generate().public_key))), dev_policy(), {}


def case_measurement_swapped(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, _set(["measurement", "code"], b64(bytes(32)))), dev_policy(), {}


def case_policy_digest_swapped(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, _set(["measurement", "policy"], b64(filled_strict().digest))), dev_policy(), {}


def case_timestamp_edited(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, _set(["freshness", "timestamp"], bundle.timestamp + 1)), dev_policy(), {}


def case_nonce_edited(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, _set(["freshness", "nonce"], b64(bytes(32)))), dev_policy(), {}


def case_gpu_state_edited(code, tmp_path):
    state = dataclasses.replace(SIM_GPU_STATE, devtools_mode=True)
    bundle = collect(SimBackend(gpu_state=state), dev_policy(), code)
    return edit_json(bundle, _set(["gpu", "state", "devtools_mode"], False)), dev_policy(), {}


def case_gpu_report_replayed(code, tmp_path):
    backend = SimBackend()
    bundle = collect(backend, dev_policy(), code)
    other = collect(backend, dev_policy(), code, nonce=bytes(32))
    return dataclasses.replace(bundle, gpu=other.gpu), dev_policy(), {}


def case_cpu_report_replayed(code, tmp_path):
    backend = SimBackend()
    bundle = collect(backend, dev_policy(), code)
    other = collect(backend, dev_policy(), code, nonce=bytes(32))
    return dataclasses.replace(bundle, cpu=other.cpu), dev_policy(), {}


def case_gpu_stripped(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, _set(["gpu"], None)), dev_policy(), {}


def case_stale(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return bundle, dev_policy(), {"now": bundle.timestamp + dev_policy().attestation.max_evidence_age_s + 1}


def case_future(code, tmp_path):
    ahead = int(time.time()) + 600
    return collect(SimBackend(clock=lambda: ahead), dev_policy(), code), dev_policy(), {}


def case_wrong_nonce(code, tmp_path):
    return collect(SimBackend(), dev_policy(), code), dev_policy(), {"expected_nonce": bytes(32)}


def case_cpu_debug_on(code, tmp_path):
    return collect(SimBackend(debug=True), dev_policy(), code), dev_policy(), {}


def case_gpu_devtools_on(code, tmp_path):
    state = dataclasses.replace(SIM_GPU_STATE, devtools_mode=True)
    return collect(SimBackend(gpu_state=state), dev_policy(), code), dev_policy(), {}


def case_cc_off(code, tmp_path):
    state = dataclasses.replace(SIM_GPU_STATE, cc_feature=False)
    return collect(SimBackend(gpu_state=state), dev_policy(), code), dev_policy(), {}


def case_cc_environment_unavailable(code, tmp_path):
    state = dataclasses.replace(SIM_GPU_STATE, environment="UNAVAILABLE")
    return collect(SimBackend(gpu_state=state), dev_policy(), code), dev_policy(), {}


def case_node_runs_other_policy(code, tmp_path):
    return collect(SimBackend(), filled_strict(), code), dev_policy(), {}


def case_code_not_allowed(code, tmp_path):
    policy = dev_variant("accept_unlisted_code = true", "accept_unlisted_code = false")
    return collect(SimBackend(), policy, code), policy, {}


def case_model_not_allowed(code, tmp_path):
    policy = dev_variant("accept_unlisted_models = true", "accept_unlisted_models = false")
    return collect(SimBackend(), policy, code), policy, {}


def case_simulated_under_strict(code, tmp_path):
    return collect(SimBackend(), dev_policy(), code), filled_strict(), {}


def case_simulated_relabelled_as_hardware(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, _set(["backend"], "nvml")), dev_policy(), {}


def case_simulated_relabelled_under_strict(code, tmp_path):
    policy = filled_strict()
    bundle = collect(SimBackend(), policy, code)
    return edit_json(bundle, _set(["backend"], "nvml")), policy, {}


def _rims(document, change):
    document["gpu"]["rims"] = change(document["gpu"]["rims"])


def _rim_xml(part, change):
    def edit(rims):
        rims[part]["xml"] = b64(change(unb64(rims[part]["xml"])))
        return rims
    return edit


def case_rims_stripped(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return dataclasses.replace(bundle, gpu=dataclasses.replace(bundle.gpu, rims=None)), dev_policy(), {}


def case_rim_measurement_edited(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    edit = _rim_xml("vbios", lambda xml: re.sub(rb'Hash0="(.)', lambda m: b'Hash0="' + (b"1" if m[1] == b"0" else b"0"),
                                                xml, count=1))
    return edit_json(bundle, lambda d: _rims(d, edit)), dev_policy(), {}


def case_rims_swapped(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, lambda d: _rims(d, lambda r: {"driver": r["vbios"], "vbios": r["driver"]})), dev_policy(), {}


def case_rims_of_another_gpu_model(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    other = collect(SimBackend(tmp_path / "another-root"), dev_policy(), code)  # signed under an unpinned root
    return dataclasses.replace(bundle, gpu=dataclasses.replace(bundle.gpu, rims=other.gpu.rims)), dev_policy(), {}


def case_ocsp_stripped(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, lambda d: d["gpu"].pop("ocsp")), dev_policy(), {}


def case_ocsp_replayed_from_other_evidence(code, tmp_path):
    backend = SimBackend()
    bundle = collect(backend, dev_policy(), code)
    other = collect(backend, dev_policy(), code, nonce=bytes(32))
    return dataclasses.replace(bundle, gpu=dataclasses.replace(bundle.gpu, ocsp=other.gpu.ocsp)), dev_policy(), {}


def case_ocsp_older_than_policy_allows(code, tmp_path):
    policy = dev_variant("max_ocsp_age_s = 86400", "max_ocsp_age_s = 60")
    bundle = collect(SimBackend(), policy, code)
    return bundle, policy, {"now": bundle.timestamp + 61}


def case_truncated_report_data(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, lambda d: d.update(report_data=d["report_data"][:-4])), dev_policy(), {}


def case_truncated_base64(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, lambda d: d.update(key_config=d["key_config"][:-1])), dev_policy(), {}


def case_truncated_gpu_report(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, lambda d: _report(d, "gpu", lambda r: r[:-12])), dev_policy(), {}


def case_unknown_version(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, _set(["version"], "veil-evidence-v9")), dev_policy(), {}


def case_duplicated_field(code, tmp_path):
    text = collect(SimBackend(), dev_policy(), code).to_json()
    return text.replace('"backend":"sim"', '"backend":"sim","backend":"sim"', 1), dev_policy(), {}


def case_unknown_field(code, tmp_path):
    bundle = collect(SimBackend(), dev_policy(), code)
    return edit_json(bundle, _set(["debug_ok"], True)), dev_policy(), {}


def case_unsupported_suite(code, tmp_path):
    config = bytearray(key_config())
    for at in range(len(config) - 12, len(config), 4):  # every AEAD id → unassigned 0x7777
        config[at + 2 : at + 4] = b"\x77\x77"
    return collect(SimBackend(), dev_policy(), code, config=bytes(config)), dev_policy(), {}


def case_malformed_key_config(code, tmp_path):
    return collect(SimBackend(), dev_policy(), code, config=key_config()[:-3]), dev_policy(), {}


def case_unsupported_kem(code, tmp_path):
    config = bytearray(key_config())
    config[1:3] = b"\x00\x99"
    return collect(SimBackend(), dev_policy(), code, config=bytes(config)), dev_policy(), {}


def case_tdx_collateral_expired(code, tmp_path):
    from tests.cpu_tee_support import cpu_policy, tcb_info_document, tdx_collateral, tdx_evidence

    policy = cpu_policy()
    stale = tdx_collateral(tcb_info_document(nextUpdate="2020-01-01T00:00:00Z"))
    return tdx_evidence(policy, collateral=stale), policy, {}


CASES = [
    (case_wrong_root, errors.ChainError),
    (case_broken_chain, errors.ChainError),
    (case_reordered_chain, errors.ChainError),
    (case_corrupted_certificate, errors.ChainError),
    (case_bad_gpu_signature, errors.SignatureError),
    (case_bad_cpu_signature, errors.SignatureError),
    (case_gpu_measurement_edited, errors.SignatureError),
    (case_cpu_debug_bit_edited, errors.SignatureError),
    (case_key_config_replaced, errors.BindingError),
    (case_receipt_key_replaced, errors.BindingError),
    (case_measurement_swapped, errors.BindingError),
    (case_policy_digest_swapped, errors.BindingError),
    (case_timestamp_edited, errors.BindingError),
    (case_nonce_edited, errors.BindingError),
    (case_gpu_state_edited, errors.BindingError),
    (case_gpu_report_replayed, errors.BindingError),
    (case_cpu_report_replayed, errors.BindingError),
    (case_gpu_stripped, errors.BindingError),
    (case_rims_stripped, errors.ReferenceMeasurementError),
    (case_rim_measurement_edited, errors.RimSignatureError),
    (case_rims_swapped, errors.FirmwareVersionError),
    (case_rims_of_another_gpu_model, errors.RimChainError),
    (case_ocsp_stripped, errors.RevocationError),
    (case_ocsp_replayed_from_other_evidence, errors.OcspNonceError),
    (case_ocsp_older_than_policy_allows, errors.OcspStaleError),
    (case_stale, errors.FreshnessError),
    (case_future, errors.FreshnessError),
    (case_wrong_nonce, errors.FreshnessError),
    (case_cc_off, errors.ConfidentialModeError),
    (case_cc_environment_unavailable, errors.ConfidentialModeError),
    (case_cpu_debug_on, errors.DebugModeError),
    (case_gpu_devtools_on, errors.DebugModeError),
    (case_node_runs_other_policy, errors.PolicyMismatchError),
    (case_code_not_allowed, errors.MeasurementNotAllowedError),
    (case_model_not_allowed, errors.MeasurementNotAllowedError),
    (case_simulated_under_strict, errors.SimulatedEvidenceError),
    (case_simulated_relabelled_as_hardware, errors.SimulatedEvidenceError),
    (case_simulated_relabelled_under_strict, errors.ChainError),
    (case_truncated_report_data, errors.EvidenceFormatError),
    (case_truncated_base64, errors.EvidenceFormatError),
    (case_truncated_gpu_report, errors.EvidenceFormatError),
    (case_unknown_version, errors.EvidenceFormatError),
    (case_duplicated_field, errors.EvidenceFormatError),
    (case_unknown_field, errors.EvidenceFormatError),
    (case_unsupported_suite, errors.KeyConfigError),
    (case_malformed_key_config, errors.KeyConfigError),
    (case_unsupported_kem, errors.KeyConfigError),
    (case_tdx_collateral_expired, errors.CollateralExpiredError),
]


def _run(make, code, tmp_path):
    made, policy, options = make(code, tmp_path)
    bundle = EvidenceBundle.from_json(made) if isinstance(made, str) else made
    return bundle, policy, options


@pytest.mark.parametrize("make,expected", CASES, ids=[make.__name__[5:] for make, _ in CASES])
def test_tampered_evidence_is_refused_by_the_intended_check(make, expected, code_digest, tmp_path):
    with pytest.raises(errors.AttestationError) as refusal:
        bundle, policy, options = _run(make, code_digest, tmp_path)
        verify(bundle, policy, **options)
    assert type(refusal.value) is expected or (
        expected is errors.EvidenceFormatError and isinstance(refusal.value, expected)
    ), f"refused by {type(refusal.value).__name__}: {refusal.value}"
    assert refusal.value.check == expected.check


@pytest.mark.parametrize("make,expected", [c for c in CASES if c[1] is not errors.EvidenceFormatError],
                         ids=[m.__name__[5:] for m, e in CASES if e is not errors.EvidenceFormatError])
def test_report_names_the_failing_check_and_runs_none_after_it(make, expected, code_digest, tmp_path):
    bundle, policy, options = _run(make, code_digest, tmp_path)
    report = verify_with_report(bundle, policy, **options)
    failed = [check for check in report.checks if check.passed is False]
    # A relabelled simulated report is caught while its signed fields are read.
    step = "signature" if make is case_simulated_relabelled_as_hardware else expected.check
    assert [check.name for check in failed] == [step]
    position = CHECK_NAMES.index(step)
    assert all(check.passed for check in report.checks[:position])
    assert all(check.passed is None for check in report.checks[position + 1 :])
    assert report.node is None and isinstance(report.error, expected)


def test_the_matrix_covers_every_check():
    covered = {expected.check for _, expected in CASES}
    assert set(CHECK_NAMES) <= covered
    assert len(CASES) >= 20


def test_error_messages_never_quote_key_material(code_digest, tmp_path):
    config = key_config()
    bundle, policy, options = _run(case_key_config_replaced, code_digest, tmp_path)
    report = verify_with_report(bundle, policy)
    text = " ".join(check.detail for check in report.checks)
    for secret in (bundle.key_config.hex(), b64(bundle.key_config), bundle.report_data.hex(), config.hex()):
        assert secret not in text
