"""Policy keys for CPU TEE evidence: the launch measurements a release names for its code digest, and
the oldest CRL accepted. The quote-signature and launch-measurement gaps no longer exist."""

from __future__ import annotations

import pytest

from policy import InvalidValueError, MissingKeyError, parse_policy
from policy.model import KNOWN_GAPS, LaunchReference
from tests.policy_support import filled_strict, filled_strict_text

CODE = "c0de" * 16
SNP = "11" * 48
MRTD = "22" * 48
RTMR = "33" * 48


def strict_with(launch: str, *, codes: str = f'["{CODE}"]', age: str = "2592000") -> str:
    text = filled_strict_text()
    for old, new in (("launch_measurements = []", f"launch_measurements = [{launch}]"),
                     ("allowed_code_digests = []", f"allowed_code_digests = {codes}"),
                     ("max_crl_age_s = 2592000", f"max_crl_age_s = {age}")):
        assert old in text
        text = text.replace(old, new)
    return text


SNP_ENTRY = f'{{ tee = "sev-snp", code = "{CODE}", measurement = "{SNP}" }}'
TDX_ENTRY = f'{{ tee = "tdx", code = "{CODE}", mrtd = "{MRTD}", rtmr1 = "{RTMR}" }}'


def test_strict_accepts_no_cpu_gap_and_lists_no_launch_measurement_yet():
    strict = filled_strict()
    assert "cpu-quote-signature" not in KNOWN_GAPS and "cpu-launch-measurement" not in KNOWN_GAPS
    assert strict.attestation.accepted_gaps == () and KNOWN_GAPS == ()
    assert strict.attestation.launch_measurements == ()
    text = filled_strict_text().replace(
        'accepted_gaps = []', 'accepted_gaps = ["cpu-quote-signature"]')
    with pytest.raises(InvalidValueError, match="accepted_gaps"):
        parse_policy(text)


def test_launch_measurements_are_read_as_references():
    policy = parse_policy(strict_with(f"{SNP_ENTRY}, {TDX_ENTRY}"))
    assert policy.attestation.launch_measurements == (
        LaunchReference("sev-snp", CODE, SNP),
        LaunchReference("tdx", CODE, MRTD, (None, RTMR, None, None)),
    )


def test_their_order_and_case_do_not_change_the_digest_but_their_values_do():
    forward = parse_policy(strict_with(f"{SNP_ENTRY}, {TDX_ENTRY}"))
    upper_tdx = f'{{ tee = "tdx", code = "{CODE.upper()}", mrtd = "{MRTD.upper()}", rtmr1 = "{RTMR.upper()}" }}'
    backward = parse_policy(strict_with(f"{upper_tdx}, {SNP_ENTRY}"))
    assert forward.digest == backward.digest
    changed = parse_policy(strict_with(f"{SNP_ENTRY}, {TDX_ENTRY.replace('rtmr1', 'rtmr2')}"))
    assert changed.digest != forward.digest


@pytest.mark.parametrize("entry,message", [
    (f'{{ tee = "sgx", code = "{CODE}", measurement = "{SNP}" }}', "tee must be one of"),
    (f'{{ tee = "sev-snp", code = "{CODE}", mrtd = "{SNP}" }}', "takes exactly"),
    (f'{{ tee = "tdx", code = "{CODE}", measurement = "{MRTD}" }}', "takes exactly"),
    (f'{{ tee = "tdx", code = "{CODE}", mrtd = "{MRTD}", rtmr4 = "{RTMR}" }}', "takes exactly"),
    (f'{{ tee = "sev-snp", code = "{CODE}", measurement = "{SNP[:-2]}" }}', "96 hexadecimal digits"),
    (f'{{ tee = "sev-snp", code = "abc", measurement = "{SNP}" }}', "64 hexadecimal digits"),
    (f'"{SNP}"', "list of tables"),
    (f"{SNP_ENTRY}, {SNP_ENTRY}", "twice"),
    (f'{{ tee = "sev-snp", code = "{"0d" * 32}", measurement = "{SNP}" }}', "allowed_code_digests does not list"),
])
def test_malformed_launch_measurements_are_refused(entry, message):
    with pytest.raises(InvalidValueError, match=message):
        parse_policy(strict_with(entry))


@pytest.mark.parametrize("age", ["0", "59", str(401 * 86_400), '"1d"'])
def test_the_crl_age_must_be_within_range(age):
    with pytest.raises(InvalidValueError, match="max_crl_age_s"):
        parse_policy(strict_with("", codes="[]", age=age))


@pytest.mark.parametrize("age", ["0", "59", str(401 * 86_400), '"1y"'])
def test_the_root_crl_age_must_be_within_range(age):
    text = filled_strict_text().replace("max_root_crl_age_s = 34560000", f"max_root_crl_age_s = {age}")
    with pytest.raises(InvalidValueError, match="max_root_crl_age_s"):
        parse_policy(text)


def test_strict_bounds_a_roots_crl_apart_from_the_crls_below_it():
    attestation = filled_strict().attestation
    assert (attestation.max_crl_age_s, attestation.max_root_crl_age_s) == (30 * 86_400, 400 * 86_400)


@pytest.mark.parametrize("key", ["max_crl_age_s", "max_root_crl_age_s", "launch_measurements"])
def test_the_new_keys_are_required(key):
    text = "\n".join(line for line in filled_strict_text().splitlines() if not line.startswith(key))
    with pytest.raises(MissingKeyError, match=key):
        parse_policy(text)
