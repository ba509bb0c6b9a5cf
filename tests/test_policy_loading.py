"""Policy loading: shipped policies, strict schema, refusal of forbidden optimizations."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

import policy
from attestation.roots import AMD_ARK_FINGERPRINTS
from policy import (
    ForbiddenOptimizationError,
    InvalidValueError,
    MissingKeyError,
    PlaceholderError,
    PolicySyntaxError,
    UnknownKeyError,
    UnknownPolicyError,
    WeakenedGuaranteeError,
    load_policy,
    parse_policy,
    shipped_policy,
    shipped_policy_path,
)
from policy.forbidden import ALIASES, KNOBS
from tests.conftest import REPO_ROOT, vectors_path
from tests.policy_support import filled_strict, filled_strict_text


def to_toml(document: dict, *, reverse: bool = False) -> str:
    """A small TOML writer for the value types policies use."""
    lines: list[str] = []
    sections = sorted(document, reverse=reverse)
    for section in sections:
        lines.append(f"[{section}]")
        for key in sorted(document[section], reverse=reverse):
            lines.append(f"{key} = {_value(document[section][key])}")
        lines.append("")
    return "\n".join(lines)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, dict):  # an inline table, as `strict`'s witness placeholders
        return "{ " + ", ".join(f"{key} = {_value(item)}" for key, item in value.items()) + " }"
    return "[" + ", ".join(_value(item) for item in value) + "]"


def strict_document() -> dict:
    """The shipped strict policy, filled in (tests/policy_support.py), as TOML data to edit."""
    return tomllib.loads(filled_strict_text())


def with_value(section: str, key: str, value: object) -> str:
    document = strict_document()
    document[section][key] = value
    return to_toml(document)


def test_strict_pins_the_nvidia_root_and_refuses_simulation():
    strict = filled_strict()
    vendor_roots = {
        x509.load_pem_x509_certificates((vectors_path() / path).read_bytes())[-1].fingerprint(hashes.SHA256()).hex()
        for path in ("nvidia-h100/device-identity-root.pem", "amd-sev-snp/ask-ark-milan.pem",
                     "intel-tdx/intel-sgx-root-ca.pem")
    }
    # NVIDIA's, AMD's ARK per product line (Milan from the vectors; Genoa's and Turin's are pinned by fingerprint,
    # checked against tests/data/ in test_attestation_sev_snp.py) and Intel's.
    assert set(strict.attestation.pinned_roots) == vendor_roots | {AMD_ARK_FINGERPRINTS[product]
                                                                   for product in ("Genoa", "Turin")}
    assert set(AMD_ARK_FINGERPRINTS.values()) <= set(strict.attestation.pinned_roots)
    assert strict.attestation.allow_simulated is False
    assert strict.attestation.trust_local_simulated_root is False
    assert strict.is_development is False
    assert strict.engine.prefix_sharing == "request"


def test_strict_pins_the_rim_root_and_accepts_no_gpu_gap():
    strict = filled_strict()
    rim_root_pem = (vectors_path() / "nvidia-h100" / "rim-root.pem").read_bytes()
    fingerprint = x509.load_pem_x509_certificate(rim_root_pem).fingerprint(hashes.SHA256()).hex()
    assert strict.attestation.pinned_rim_roots == (fingerprint,)
    assert fingerprint not in strict.attestation.pinned_roots  # the RIM root signs no device chain
    assert not [gap for gap in strict.attestation.accepted_gaps if gap.startswith("gpu-")]
    assert strict.attestation.max_ocsp_age_s == 86_400


def test_dev_accepts_simulation_and_says_so():
    dev = shipped_policy("dev")
    assert dev.is_development
    assert dev.attestation.trust_local_simulated_root
    assert "DEVELOPMENT" in shipped_policy_path("dev").read_text()
    assert dev.digest != filled_strict().digest


STRICT_PLACEHOLDERS = ("transparency.log_key", "transparency.witnesses[0].key", "transparency.witnesses[1].key",
                       "transparency.witnesses[2].key")


def test_strict_as_shipped_is_refused_naming_each_empty_key():
    """Its log and witness keys are the operator's to fill: until then it is refused, not loaded to admit no node."""
    for load in (lambda: shipped_policy("strict"), lambda: load_policy(shipped_policy_path("strict"))):
        with pytest.raises(PlaceholderError) as refused:
            load()
        assert refused.value.paths == STRICT_PLACEHOLDERS
        message = str(refused.value)
        assert all(path in message for path in STRICT_PLACEHOLDERS), message
        for advice in ("`veil log init`", "`veil witness --new-key`", "`veil policy check FILE`", "`dev`"):
            assert advice in message, advice
    readme, security = ((REPO_ROOT / name).read_text() for name in ("README.md", "SECURITY.md"))
    assert 'README.md, "Deploying on confidential-computing nodes"' in message
    assert "\n## Deploying on confidential-computing nodes\n" in readme
    assert 'SECURITY.md, "The transparency log (foundations)"' in message
    assert "\n#### The transparency log (foundations)\n" in security


def test_unknown_shipped_name_is_refused():
    with pytest.raises(UnknownPolicyError):
        shipped_policy("production")  # type: ignore[arg-type]


def test_policy_is_frozen():
    strict = filled_strict()
    with pytest.raises(AttributeError):
        strict.name = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        strict.engine.prefix_sharing = "global"  # type: ignore[misc]


@pytest.mark.parametrize("knob", KNOBS, ids=lambda knob: f"{knob.section}.{knob.key}")
def test_every_forbidden_knob_value_is_refused_with_its_requirement(knob):
    with pytest.raises(ForbiddenOptimizationError) as refusal:
        parse_policy(with_value(knob.section, knob.key, "enabled-elsewhere"))
    assert refusal.value.requirement == knob.requirement
    assert knob.requirement in str(refusal.value)


@pytest.mark.parametrize("knob", KNOBS, ids=lambda knob: f"{knob.section}.{knob.key}")
def test_every_knob_accepts_its_safe_values(knob):
    for value in knob.allowed:
        loaded = parse_policy(with_value(knob.section, knob.key, value))
        assert getattr(getattr(loaded, knob.section), knob.key) == value


@pytest.mark.parametrize("alias", ALIASES, ids=lambda alias: f"{alias.section}.{alias.key}")
def test_foreign_switches_for_forbidden_optimizations_are_refused(alias):
    with pytest.raises(ForbiddenOptimizationError) as refusal:
        parse_policy(with_value(alias.section, alias.key, True))
    assert refusal.value.requirement == alias.requirement


# The forbidden rows of ARCHITECTURE.md's optimization table, as a policy would spell them.
ARCHITECTURE_TABLE = [
    ("prefix caching across requests", "engine", "prefix_sharing", "global", "stateless computation"),
    ("KV offload to host memory", "engine", "kv_offload", "host", "stateless computation"),
    ("KV offload to disk", "engine", "kv_offload", "disk", "stateless computation"),
    ("KV duplication across nodes", "engine", "kv_replication", "all-nodes", "stateless computation"),
    ("KV pulling / request migration", "engine", "kv_migration", "pull", "non-targetability"),
    ("priority by user", "engine", "scheduling", "user-priority", "non-targetability"),
    ("priority by predicted length", "engine", "scheduling", "shortest-first", "non-targetability"),
    ("speculation from a database", "engine", "speculation", "database", "stateless computation"),
    ("cache-aware routing", "routing", "strategy", "cache-aware", "non-targetability"),
    ("sticky routing", "routing", "strategy", "sticky", "non-targetability"),
    ("prefill/decode role flips", "routing", "strategy", "prefill-decode-split", "non-targetability"),
    ("fleet-wide profiling", "audit", "profiling", "fleet-traces", "no privileged runtime access"),
]


@pytest.mark.parametrize("row", ARCHITECTURE_TABLE, ids=lambda row: row[0])
def test_architecture_table_is_enforced(row):
    _, section, key, value, requirement = row
    with pytest.raises(ForbiddenOptimizationError) as refusal:
        parse_policy(with_value(section, key, value))
    assert refusal.value.requirement == requirement


def test_allowed_optimizations_load():
    loaded = parse_policy(with_value("engine", "speculation", "draft-model"))
    assert loaded.engine.speculation == "draft-model"
    assert parse_policy(with_value("engine", "prefix_sharing", "off")).engine.prefix_sharing == "off"


@pytest.mark.parametrize("section", ["policy", "attestation", "engine", "routing", "audit"])
def test_unknown_keys_are_errors(section):
    with pytest.raises(UnknownKeyError):
        parse_policy(with_value(section, "colour", "blue"))


def test_unknown_section_is_an_error():
    document = strict_document()
    document["extras"] = {"anything": 1}
    with pytest.raises(UnknownKeyError):
        parse_policy(to_toml(document))


@pytest.mark.parametrize(
    "section,key",
    [("attestation", "max_evidence_age_s"), ("engine", "max_context_tokens"),
     ("routing", "candidates"), ("routing", "max_node_capacity"), ("audit", "sink"), ("policy", "name")],
)
def test_missing_required_keys_are_errors(section, key):
    document = strict_document()
    del document[section][key]
    with pytest.raises(MissingKeyError):
        parse_policy(to_toml(document))


def test_missing_section_is_an_error():
    document = strict_document()
    del document["routing"]
    with pytest.raises(MissingKeyError):
        parse_policy(to_toml(document))


@pytest.mark.parametrize(
    "section,key,value",
    [
        ("attestation", "max_evidence_age_s", 0),
        ("attestation", "max_evidence_age_s", True),
        ("attestation", "max_evidence_age_s", "300"),
        ("attestation", "pinned_roots", ["not-a-fingerprint"]),
        ("attestation", "pinned_roots", ["ab" * 32, "AB" * 32]),
        ("attestation", "required_confidential_mode", ["cpu", "tpm"]),
        ("attestation", "accepted_gaps", ["everything"]),
        ("attestation", "accepted_gaps", ["gpu-revocation"]),  # checked now: no longer a gap to accept
        ("attestation", "pinned_rim_roots", ["not-a-fingerprint"]),
        ("attestation", "max_ocsp_age_s", 59),
        ("attestation", "max_ocsp_age_s", 8 * 86_400),
        ("attestation", "allow_simulated", "no"),
        ("engine", "max_context_tokens", -1),
        ("engine", "allowed_model_digests", ["12" * 31]),
        ("routing", "candidates", 0),
        ("routing", "candidates", 9),
        ("routing", "capacity_weighting", False),
        ("routing", "max_node_capacity", 0),
        ("routing", "max_node_capacity", 1 << 17),
        ("routing", "max_node_capacity", "64"),
        ("audit", "sink", "syslog"),
        ("audit", "schema_version", 0),
        ("policy", "name", "Has Spaces"),
        ("policy", "format", 2),
    ],
)
def test_invalid_values_are_refused(section, key, value):
    with pytest.raises(InvalidValueError):
        parse_policy(with_value(section, key, value))


@pytest.mark.parametrize(
    "section,key",
    [("attestation", "trust_local_simulated_root"), ("attestation", "accept_unlisted_code"),
     ("engine", "accept_unlisted_models")],
)
def test_development_settings_need_simulation_opt_in(section, key):
    with pytest.raises(InvalidValueError, match="development setting"):
        parse_policy(with_value(section, key, True))


def test_debug_cannot_be_allowed():
    with pytest.raises(WeakenedGuaranteeError) as refusal:
        parse_policy(with_value("attestation", "debug_forbidden", False))
    assert refusal.value.requirement == "no privileged runtime access"


def test_confidential_mode_cannot_be_dropped():
    with pytest.raises(WeakenedGuaranteeError):
        parse_policy(with_value("attestation", "required_confidential_mode", []))


def test_a_policy_must_pin_a_root():
    with pytest.raises(InvalidValueError, match="pin at least one root"):
        parse_policy(with_value("attestation", "pinned_roots", []))


def test_syntax_errors_and_unreadable_files(tmp_path: Path):
    with pytest.raises(PolicySyntaxError):
        parse_policy("[attestation\nmax = ")
    with pytest.raises(PolicySyntaxError):
        load_policy(tmp_path / "absent.toml")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PolicySyntaxError):
        load_policy(binary)


def test_every_error_is_a_policy_error():
    for error in (ForbiddenOptimizationError, InvalidValueError, MissingKeyError, PolicySyntaxError,
                  UnknownKeyError, UnknownPolicyError, WeakenedGuaranteeError):
        assert issubclass(error, policy.PolicyError)


def test_authorization_keys_need_an_issuer_name():
    listed = with_value("authorization", "issuer_keys", ["ab" * 32])
    with pytest.raises(InvalidValueError, match="issuer_name"):
        parse_policy(listed)
    document = tomllib.loads(listed)
    document["authorization"]["issuer_name"] = "issuer.example"
    loaded = parse_policy(to_toml(document))
    assert loaded.authorization.issuer_keys == ("ab" * 32,) and loaded.authorization.issuer_name == "issuer.example"
    for bad_name in ("Issuer.Example", "issuer example", 7):
        document["authorization"]["issuer_name"] = bad_name
        with pytest.raises(InvalidValueError):
            parse_policy(to_toml(document))
