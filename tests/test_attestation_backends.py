"""Backends: selection and probing, the simulated root, NVML and configfs-tsm on a machine without them,
CPU quote parsing, and hardware-shaped evidence through the verifier."""

from __future__ import annotations

import ctypes
import datetime as dt
import os
import stat
import struct
import time
from pathlib import Path

import pytest

from attestation import checks, errors, gpu_checks
from attestation.backends import SimulatedAttestationWarning, get_backend
from attestation.backends.base import bind
from attestation.backends.nvml import NvmlStatus, require_production_cc
from attestation.backends.sim import SimBackend
from attestation.backends.tsm import tsm_quote
from attestation.bundle import CpuEvidence, EvidenceBundle, GpuEvidence, GpuRims, GpuState, StapledRim
from attestation.certs import pem_chain_to_der
from attestation.cpu_reports import SNP_REPORT_SIZE, CpuReportFormatError, parse_cpu_report
from attestation.sim_root import load_or_create_sim_root, local_sim_root_certificate
from attestation.spdm import parse_report
from attestation.verifier import verify, verify_with_report
from policy import parse_policy, shipped_policy, shipped_policy_path
from tests.conftest import vectors_path
from tests.test_attestation_nvidia_vectors import CHAIN, REPORT
from tests.test_attestation_support import (  # noqa: F401  (fixtures)
    NONCE,
    code_digest,
    collect,
    dev_policy,
    key_config,
    measurement_for,
    sim_root_dir,
)


def _nvml_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


NVML_PRESENT = _nvml_library_present()


def test_sim_root_is_created_on_first_use_with_private_permissions(sim_root_dir: Path):
    assert local_sim_root_certificate() is None  # the verifier never creates one
    root = load_or_create_sim_root()
    assert stat.S_IMODE(os.stat(sim_root_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(sim_root_dir / "root.pem").st_mode) == 0o600
    assert load_or_create_sim_root().fingerprint == root.fingerprint
    assert local_sim_root_certificate() == root.certificate
    assert "SIMULATED" in root.certificate.subject.rfc4514_string()


def test_a_corrupt_sim_root_says_how_to_recover(sim_root_dir: Path):
    sim_root_dir.mkdir()
    (sim_root_dir / "root.pem").write_text("garbage")
    with pytest.raises(errors.BackendError, match="delete the folder"):
        load_or_create_sim_root()


def test_sim_evidence_passes_the_dev_policy_and_is_labelled(code_digest):
    bundle = collect(SimBackend(), dev_policy(), code_digest)
    node = verify(bundle, dev_policy(), expected_nonce=NONCE)
    assert node.simulated and node.backend == "sim"
    assert node.expires_at == bundle.timestamp + dev_policy().attestation.max_evidence_age_s
    assert node.policy_digest == dev_policy().digest
    assert [check.name for check in node.checks][0] == "simulated"
    assert all(check.passed for check in node.checks)
    assert "SIMULATED" in node.checks[0].detail
    assert parse_report(bundle.gpu.report).is_simulated


def test_node_id_is_the_same_for_every_verifier(code_digest):
    backend = SimBackend()
    config = key_config()
    first = verify(collect(backend, dev_policy(), code_digest, config=config), dev_policy())
    second = verify(collect(backend, dev_policy(), code_digest, config=config, nonce=bytes(32)), dev_policy())
    other_key = verify(collect(backend, dev_policy(), code_digest), dev_policy())
    assert first.node_id == second.node_id != other_key.node_id
    assert len(first.node_id) == 32


def test_named_backends_and_unknown_names():
    assert isinstance(get_backend("sim"), SimBackend)
    with pytest.raises(errors.BackendError, match="unknown"):
        get_backend("sgx")  # type: ignore[arg-type]


@pytest.mark.skipif(NVML_PRESENT, reason="this machine has NVIDIA's driver; see test_nvml_on_a_gpu_machine")
def test_nvml_backend_says_nvml_is_missing():
    with pytest.raises(errors.NvmlMissingError, match="NVML is missing"):
        get_backend("nvml")


@pytest.mark.gpu
@pytest.mark.skipif(not NVML_PRESENT, reason="needs NVIDIA's driver")
def test_nvml_on_a_gpu_machine():
    # Either the GPU is in production CC mode and evidence verifies, or collection says CC is off.
    try:
        backend = get_backend("nvml")
    except errors.BackendUnavailableError as error:
        pytest.fail(f"NVML present but unusable: {error}")
    try:
        bundle = backend.collect(key_config(), measurement_for(shipped_policy("strict"), bytes(32)), NONCE)
    except errors.GpuConfidentialModeOffError as error:
        assert "confidential computing is not in production mode" in str(error)
        return
    assert bundle.gpu is not None and bundle.gpu.kind == "nvidia-hopper"


def test_cc_off_is_reported_with_the_settings():
    status = NvmlStatus(1, "NVIDIA H100 80GB HBM3", GpuState("UNAVAILABLE", cc_feature=False, devtools_mode=False))
    with pytest.raises(errors.GpuConfidentialModeOffError) as refusal:
        require_production_cc(status)
    assert "ccFeature off" in str(refusal.value) and "no evidence was collected" in str(refusal.value)
    require_production_cc(NvmlStatus(1, "H100", GpuState("PROD", cc_feature=True, devtools_mode=False)))
    with pytest.raises(errors.GpuConfidentialModeOffError, match="devToolsMode on"):
        require_production_cc(NvmlStatus(1, "H100", GpuState("PROD", cc_feature=True, devtools_mode=True)))


def test_tsm_backend_says_configfs_tsm_is_missing(tmp_path: Path):
    with pytest.raises(errors.TsmUnavailableError, match="configfs-tsm is not available"):
        get_backend("tsm", root=tmp_path / "no-tsm")
    with pytest.raises(errors.TsmUnavailableError, match="not a configfs-tsm report directory"):
        tsm_quote(bytes(64), tmp_path)  # an ordinary folder: mkdir works but no inblob appears
    assert list(tmp_path.iterdir()) == []  # the entry was removed again
    with pytest.raises(errors.BackendError, match="64 bytes"):
        tsm_quote(bytes(63), tmp_path)


@pytest.mark.skipif(NVML_PRESENT or Path("/sys/kernel/config/tsm/report").is_dir(), reason="hardware present")
def test_probing_never_picks_simulation_silently():
    with pytest.raises(errors.BackendUnavailableError) as refusal:
        get_backend(None)
    assert "nvml" in str(refusal.value) and "tsm" in str(refusal.value)
    with pytest.raises(errors.BackendUnavailableError):
        get_backend(None, policy=shipped_policy("strict"))
    with pytest.warns(SimulatedAttestationWarning, match="SIMULATED"):
        backend = get_backend(None, policy=dev_policy())
    assert backend.name == "sim"


# --- CPU TEE quotes (configfs-tsm formats) ---------------------------------------------------

def tdx_quote(report_data: bytes, *, debug: bool = False) -> bytes:
    header = struct.pack("<HHI", 4, 2, 0x81) + bytes(40)
    body = bytearray(584)
    struct.pack_into("<Q", body, 120, 1 if debug else 0)
    body[520:584] = report_data
    return header + bytes(body) + b"\x00" * 100  # signature data follows; not verified offline


def snp_report(report_data: bytes, *, debug: bool = False) -> bytes:
    report = bytearray(SNP_REPORT_SIZE)
    struct.pack_into("<I", report, 0, 2)
    struct.pack_into("<Q", report, 0x08, (1 << 19 if debug else 0) | (1 << 17))
    struct.pack_into("<I", report, 0x34, 1)
    report[0x50:0x90] = report_data
    return bytes(report)


def test_tdx_and_snp_report_data_offsets():
    data = bytes(range(64))
    tdx = parse_cpu_report("tdx", tdx_quote(data, debug=True))
    assert tdx.report_data == data and tdx.debug and not tdx.simulated
    assert tdx_quote(data)[568:632] == data
    snp = parse_cpu_report("sev-snp", snp_report(data))
    assert snp.report_data == data and not snp.debug
    assert parse_cpu_report("sev-snp", snp_report(data, debug=True)).debug


@pytest.mark.parametrize("kind,report", [("tdx", b"\x04\x00" + bytes(100)), ("sev-snp", bytes(100)),
                                         ("tdx", bytes(700)), ("sim", bytes(176))])
def test_malformed_cpu_reports(kind, report):
    with pytest.raises(CpuReportFormatError):
        parse_cpu_report(kind, report)


def cpu_only_policy(gaps: str) -> object:
    text = shipped_policy_path("strict").read_text()
    text = text.replace('required_confidential_mode = ["cpu", "gpu"]', 'required_confidential_mode = ["cpu"]')
    text = text.replace('allowed_code_digests = []', f'allowed_code_digests = ["{"00" * 32}"]')
    text = text.replace('allowed_model_digests = []', 'allowed_model_digests = ["ab0e0a8e2b3a3b1e2cc3d7a0b5bd5b04bd0f1cc07e8c2d5fa45e5ab2b3f3f4a1"]')
    return parse_policy(text.replace('accepted_gaps = ["cpu-launch-measurement", "cpu-quote-signature"]', gaps))


def tsm_bundle(policy, make_quote, kind: str, *, debug: bool = False) -> EvidenceBundle:
    measurement = measurement_for(policy, bytes(32))
    config, timestamp = key_config(), int(time.time())
    bound = bind(config, measurement, NONCE, timestamp, b"")
    return EvidenceBundle(backend="tsm", key_config=config, measurement=measurement, nonce=NONCE,
                          timestamp=timestamp, report_data=bound,
                          cpu=CpuEvidence(kind, make_quote(bound, debug=debug), ()), gpu=None)


@pytest.mark.parametrize("kind,make_quote", [("tdx", tdx_quote), ("sev-snp", snp_report)])
def test_cpu_quotes_need_the_policy_to_accept_the_unverified_signature_gap(kind, make_quote):
    strict_gaps = cpu_only_policy('accepted_gaps = []')
    with pytest.raises(errors.ChainError, match="cpu-quote-signature"):
        verify(tsm_bundle(strict_gaps, make_quote, kind), strict_gaps)
    lenient = cpu_only_policy('accepted_gaps = ["cpu-quote-signature"]')
    report = verify_with_report(tsm_bundle(lenient, make_quote, kind), lenient)
    details = {check.name: check.detail for check in report.checks}
    assert "NOT verified" in details["chain"] and "NOT verified" in details["signature"]
    # The remaining failure is the measurement allowlist: the code digest is listed, the model's is not.
    assert isinstance(report.error, errors.MeasurementNotAllowedError)
    assert all(check.passed for check in report.checks[: report.checks.index(
        next(check for check in report.checks if check.passed is False))])


@pytest.mark.parametrize("kind,make_quote", [("tdx", tdx_quote), ("sev-snp", snp_report)])
def test_cpu_debug_bits_are_refused(kind, make_quote):
    policy = cpu_only_policy('accepted_gaps = ["cpu-quote-signature"]')
    with pytest.raises(errors.DebugModeError):
        verify(tsm_bundle(policy, make_quote, kind, debug=True), policy)


def test_cpu_only_evidence_fails_a_policy_that_requires_the_gpu():
    policy = parse_policy(shipped_policy_path("strict").read_text())
    with pytest.raises(errors.ConfidentialModeError, match="GPU"):
        verify(tsm_bundle(policy, tdx_quote, "tdx"), policy)


def hopper_bundle(policy, report: bytes = REPORT, chain: tuple[bytes, ...] = CHAIN, rims: GpuRims | None = None) -> EvidenceBundle:
    measurement = measurement_for(policy, bytes(32))
    config = key_config()
    state = GpuState("PROD", cc_feature=True, devtools_mode=False)
    timestamp = int(time.time())
    bound = bind(config, measurement, NONCE, timestamp, state.encode())
    return EvidenceBundle(backend="nvml", key_config=config, measurement=measurement, nonce=NONCE,
                          timestamp=timestamp, report_data=bound, cpu=None,
                          gpu=GpuEvidence("nvidia-hopper", report, chain, state, rims=rims))


def test_genuine_h100_report_runs_through_the_verifier_chain_and_signature_checks():
    policy = shipped_policy("strict")
    report = verify_with_report(hopper_bundle(policy), policy)
    by_name = {check.name: check for check in report.checks}
    assert by_name["chain"].passed and by_name["signature"].passed
    # NVIDIA published no RIM for this report's firmware: without RIMs the GPU is refused, naming them.
    assert isinstance(report.error, errors.ReferenceMeasurementError)
    assert "no driver and VBIOS RIMs" in str(report.error)


RIM_VECTORS = vectors_path() / "nvidia-h100-rim"
REPORT_2023 = bytes.fromhex((RIM_VECTORS / "attestation-report-2023.hex").read_text().strip())
CHAIN_2023 = pem_chain_to_der((RIM_VECTORS / "cert-chain-2023.pem").read_bytes())
RIM_TIME = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)  # inside the RIM signing leaves' validity


def rims_2023(vbios: str = "vbios-rim-96.00.5E.00.01.swidtag") -> GpuRims:
    return GpuRims(StapledRim((RIM_VECTORS / "driver-rim-545.00.swidtag").read_bytes(), ()),
                   StapledRim((RIM_VECTORS / vbios).read_bytes(), ()))


def test_the_2023_h100_report_passes_the_verifiers_reference_check_with_its_rims():
    policy = shipped_policy("strict")
    bundle = hopper_bundle(policy, REPORT_2023, CHAIN_2023, rims_2023())
    report = verify_with_report(bundle, policy, chain_time=RIM_TIME)
    by_name = {check.name: check for check in report.checks}
    assert by_name["reference measurements"].passed
    assert "driver 545.00 and VBIOS 96.00.5E.00.01" in by_name["reference measurements"].detail
    # The genuine report answers NVIDIA's sample nonce, not this bundle's SHA-256(report_data).
    assert isinstance(report.error, errors.BindingError)


def test_the_verifier_refuses_the_2023_report_with_the_production_vbios_rim_at_indexes_1_2_3_9():
    policy = shipped_policy("strict")
    bundle = hopper_bundle(policy, REPORT_2023, CHAIN_2023, rims_2023("vbios-rim-96.00.5E.00.01-prod.swidtag"))
    with pytest.raises(errors.MeasurementMismatchError, match=r"1, 2, 3, 9") as refusal:
        verify(bundle, policy, chain_time=RIM_TIME)
    assert refusal.value.indexes == (1, 2, 3, 9)


def test_hardware_gpu_evidence_without_ocsp_responses_is_refused_naming_them():
    # Past the reference check (the 2023 RIMs) and with the binding and freshness of a fresh bundle faked
    # by running the revocation check alone: it names the missing OCSP responses of the device chain.
    policy = shipped_policy("strict")
    ctx = checks.Context(hopper_bundle(policy, REPORT_2023, CHAIN_2023, rims_2023()), policy, time.time(), None, RIM_TIME)
    checks.check_chain(ctx)
    with pytest.raises(errors.RevocationError, match="GPU device chain carries no OCSP responses"):
        gpu_checks.check_revocation(ctx)


def test_the_vectors_directory_is_the_one_tested():
    assert (vectors_path() / "nvidia-h100" / "attestation-report.hex").is_file()


@pytest.mark.parametrize("kind,make_quote", [("tdx", tdx_quote), ("sev-snp", snp_report)])
def test_hardware_evidence_needs_the_launch_measurement_gap_named(kind, make_quote):
    # Without it the verifier refuses: the code digest would be the node's own unproven claim.
    without = cpu_only_policy('accepted_gaps = ["cpu-quote-signature"]')
    report = verify_with_report(tsm_bundle(without, make_quote, kind), without)
    assert isinstance(report.error, errors.MeasurementNotAllowedError)
    assert "cpu-launch-measurement" in str(report.error)
    named = cpu_only_policy('accepted_gaps = ["cpu-launch-measurement", "cpu-quote-signature"]')
    report = verify_with_report(tsm_bundle(named, make_quote, kind), named)
    # Past the gap, what remains is the allowlist (this bundle's model digest is not listed).
    assert "cpu-launch-measurement" not in str(report.error)


def test_the_operators_collateral_folder_is_stapled_in_chain_order(tmp_path):
    from attestation.backends.gpu_collateral import read_collateral

    assert read_collateral(None) == ((), None)
    assert read_collateral(tmp_path) == ((), None)  # nothing fetched yet: the verifier will name what is missing
    for name, data in {"driver.swidtag": b"<driver/>", "vbios.swidtag": b"<vbios/>", "device-ocsp-1.der": b"d1",
                       "device-ocsp-2.der": b"d2", "device-ocsp-4.der": b"gap", "driver-ocsp-0.der": b"r0",
                       "vbios-ocsp-0.der": b"v0", "vbios-ocsp-1.der": b"v1"}.items():
        (tmp_path / name).write_bytes(data)
    device, rims = read_collateral(tmp_path)
    assert device == (b"d1", b"d2")  # stops at the first missing position
    assert rims == GpuRims(StapledRim(b"<driver/>", (b"r0",)), StapledRim(b"<vbios/>", (b"v0", b"v1")))
