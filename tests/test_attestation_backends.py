"""Backends: selection and probing, the simulated root, NVML and configfs-tsm on a machine without them,
CPU quote parsing, and hardware-shaped evidence through the verifier."""

from __future__ import annotations

import ctypes
import datetime as dt
import os
import stat
import time
from pathlib import Path

import pytest

from attestation import checks, errors, gpu_checks
from attestation.backends import SimulatedAttestationWarning, get_backend
from attestation.backends.nvml import NvmlStatus, require_production_cc
from attestation.backends.sim import SimBackend
from attestation.backends.tsm import tsm_quote
from attestation.bundle import GpuRims, GpuState, StapledRim
from attestation.certs import pem_chain_to_der
from attestation.checks import Context, check_measurement
from attestation.cpu_reports import CpuReportFormatError, parse_cpu_report
from attestation.sim_root import load_or_create_sim_root, local_sim_root_certificate
from attestation.spdm import parse_report
from attestation.verifier import verify, verify_with_report
from tests.conftest import vectors_path
from tests.cpu_tee_support import SnpFields, TdxFields, cpu_policy, genuine_snp, genuine_tdx, snp_evidence, tdx_evidence
from tests.policy_support import filled_strict
from tests.test_attestation_nvidia_vectors import hopper_bundle
from tests.test_attestation_support import (  # noqa: F401  (fixtures)
    NONCE,
    RECEIPT_KEY,
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
        bundle = backend.collect(key_config(), measurement_for(filled_strict(), bytes(32)), NONCE, RECEIPT_KEY)
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
        get_backend(None, policy=filled_strict())
    with pytest.warns(SimulatedAttestationWarning, match="SIMULATED"):
        backend = get_backend(None, policy=dev_policy())
    assert backend.name == "sim"


# --- CPU TEE quotes (configfs-tsm formats) ---------------------------------------------------

def test_tdx_and_snp_report_data_offsets():
    report, _ = genuine_snp()
    snp = parse_cpu_report("sev-snp", report)
    assert snp.report_data == bytes.fromhex("0102030405") + bytes(59) and snp.report_data == report[0x50:0x90]
    assert snp.debug and not snp.simulated  # the genuine guest policy allows debugging (bit 19)
    tdx = parse_cpu_report("tdx", genuine_tdx("quote-spr-e4.bin"))
    assert tdx.report_data.hex().startswith("6c62dec1b8191749") and not tdx.debug and not tdx.simulated


@pytest.mark.parametrize("kind,report", [("tdx", b"\x04\x00" + bytes(100)), ("sev-snp", bytes(100)),
                                         ("tdx", bytes(700)), ("sim", bytes(176))])
def test_malformed_cpu_reports(kind, report):
    with pytest.raises(CpuReportFormatError):
        parse_cpu_report(kind, report)


@pytest.mark.parametrize("evidence,fields", [(snp_evidence, SnpFields(policy=(1 << 17) | (1 << 19))),
                                             (tdx_evidence, TdxFields(td_attributes=1))])
def test_cpu_debug_bits_are_refused(evidence, fields):
    policy = cpu_policy()
    with pytest.raises(errors.DebugModeError, match="allows debugging"):
        verify(evidence(policy, fields), policy)


def test_cpu_only_evidence_fails_a_policy_that_requires_the_gpu():
    policy = cpu_policy(modes='["cpu", "gpu"]')
    with pytest.raises(errors.ConfidentialModeError, match="GPU"):
        verify(tdx_evidence(policy), policy)


RIM_VECTORS = vectors_path() / "nvidia-h100-rim"
REPORT_2023 = bytes.fromhex((RIM_VECTORS / "attestation-report-2023.hex").read_text().strip())
CHAIN_2023 = pem_chain_to_der((RIM_VECTORS / "cert-chain-2023.pem").read_bytes())
RIM_TIME = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)  # inside the RIM signing leaves' validity


def rims_2023(vbios: str = "vbios-rim-96.00.5E.00.01.swidtag") -> GpuRims:
    return GpuRims(StapledRim((RIM_VECTORS / "driver-rim-545.00.swidtag").read_bytes(), ()),
                   StapledRim((RIM_VECTORS / vbios).read_bytes(), ()))


def test_the_2023_h100_report_passes_the_verifiers_reference_check_with_its_rims():
    policy = filled_strict()
    bundle = hopper_bundle(policy, REPORT_2023, CHAIN_2023, rims_2023())
    report = verify_with_report(bundle, policy, chain_time=RIM_TIME)
    by_name = {check.name: check for check in report.checks}
    assert by_name["reference measurements"].passed
    assert "driver 545.00 and VBIOS 96.00.5E.00.01" in by_name["reference measurements"].detail
    # The genuine report answers NVIDIA's sample nonce, not this bundle's SHA-256(report_data).
    assert isinstance(report.error, errors.BindingError)


def test_the_verifier_refuses_the_2023_report_with_the_production_vbios_rim_at_indexes_1_2_3_9():
    policy = filled_strict()
    bundle = hopper_bundle(policy, REPORT_2023, CHAIN_2023, rims_2023("vbios-rim-96.00.5E.00.01-prod.swidtag"))
    with pytest.raises(errors.MeasurementMismatchError, match=r"1, 2, 3, 9") as refusal:
        verify(bundle, policy, chain_time=RIM_TIME)
    assert refusal.value.indexes == (1, 2, 3, 9)


def test_hardware_gpu_evidence_without_ocsp_responses_is_refused_naming_them():
    # Past the reference check (the 2023 RIMs) and with the binding and freshness of a fresh bundle faked
    # by running the revocation check alone: it names the missing OCSP responses of the device chain.
    policy = filled_strict()
    ctx = checks.Context(hopper_bundle(policy, REPORT_2023, CHAIN_2023, rims_2023()), policy, time.time(), None, RIM_TIME)
    checks.check_chain(ctx)
    with pytest.raises(errors.RevocationError, match="GPU device chain carries no OCSP responses"):
        gpu_checks.check_revocation(ctx)


def test_the_vectors_directory_is_the_one_tested():
    assert (vectors_path() / "nvidia-h100" / "attestation-report.hex").is_file()


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


def test_hardware_evidence_without_a_cpu_report_cannot_tie_its_code_digest():
    # A GPU-only node's code digest is its own claim: no launch measurement backs it.
    policy = cpu_policy(modes='["gpu"]', extra=f', "{"00" * 32}"')
    context = Context(hopper_bundle(policy), policy, time.time(), None, dt.datetime.now(dt.timezone.utc))
    with pytest.raises(errors.LaunchMeasurementError, match="no CPU TEE report"):
        check_measurement(context)
