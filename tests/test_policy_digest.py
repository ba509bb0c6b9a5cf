"""The policy digest names the policy's meaning: stable under reformatting, changed by any edit."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import pytest

from policy import load_policy, parse_policy, shipped_policy_path
from policy.canonical import canonical_encoding
from tests.policy_support import filled_strict, filled_strict_text
from tests.test_policy_loading import strict_document, to_toml, with_value


def test_digest_is_sha256_of_the_canonical_encoding():
    strict = filled_strict()
    assert strict.digest == hashlib.sha256(canonical_encoding(strict)).digest()
    document = json.loads(canonical_encoding(strict))
    assert document["format"] == "veil-policy-v1"
    assert document["engine"]["prefix_sharing"] == "request"


def test_digest_survives_reformatting(tmp_path: Path):
    original = filled_strict()
    document = strict_document()
    reordered = to_toml(document, reverse=True)  # keys and sections in another order, no comments
    assert parse_policy(reordered).digest == original.digest
    document["attestation"]["pinned_roots"].reverse()  # set-like lists: order is not meaning
    assert parse_policy(to_toml(document)).digest == original.digest
    spaced = filled_strict_text().replace(" = ", "   =   ") + "\n# trailing comment\n"
    path = tmp_path / "spaced.toml"
    path.write_text(spaced)
    assert load_policy(path).digest == original.digest


def test_digest_survives_other_toml_spellings():
    text = filled_strict_text()
    dotted = text.replace("[routing]\ncandidates = 3", "[routing]\n\"candidates\" = 0x3")
    assert dotted != text
    assert parse_policy(dotted).digest == filled_strict().digest


def test_omitted_knobs_mean_their_safe_default():
    document = strict_document()
    del document["engine"]["kv_offload"]
    del document["routing"]["strategy"]
    assert parse_policy(to_toml(document)).digest == filled_strict().digest


def _semantic_edits() -> list[tuple[str, str, object]]:
    return [
        ("policy", "name", "strict-2"),
        ("attestation", "pinned_roots", ["00" * 32]),
        ("attestation", "allowed_code_digests", ["11" * 32]),
        ("attestation", "max_evidence_age_s", 301),
        ("attestation", "max_clock_skew_s", 0),
        ("attestation", "max_ocsp_age_s", 3600),
        ("attestation", "max_crl_age_s", 86_400),
        ("attestation", "max_root_crl_age_s", 86_400),
        ("attestation", "pinned_rim_roots", ["00" * 32]),
        ("attestation", "required_confidential_mode", ["gpu"]),
        ("engine", "max_context_tokens", 8193),
        ("engine", "kv_budget_mib", 1),
        ("engine", "prefix_sharing", "off"),
        ("engine", "allowed_model_digests", ["22" * 32]),
        ("engine", "speculation", "draft-model"),
        ("engine", "control_tokens_in_content", True),
        ("routing", "candidates", 4),
        ("audit", "schema_version", 2),
        ("routing", "max_node_capacity", 65),
        ("audit", "sink", "stderr"),
        ("attestation", "tdx_accepted_tcb_statuses", ["UpToDate", "SWHardeningNeeded"]),
        ("attestation", "tdx_accepted_advisories", ["INTEL-SA-00615"]),
        ("attestation", "tdx_max_collateral_age_s", 86_400),
        ("attestation", "tdx_min_tcb_evaluation_data_number", 19),
        ("attestation", "tdx_fmspcs", ["50806f000000"]),
        ("attestation", "tdx_mr_seams", ["00" * 48]),
        ("attestation", "tdx_mr_config_id", "00" * 48),
        ("attestation", "tdx_mr_owner", "00" * 48),
        ("attestation", "tdx_mr_owner_config", "00" * 48),
        ("attestation", "tdx_min_tee_tcb_svn", "00" * 16),
        ("attestation", "tdx_qe_vendor_id", "939a7233f79c4ca9940a0db3957f0607"),
        ("attestation", "sev_snp_min_tcb", [{"product": "Milan", "boot_loader": 0, "tee": 0, "snp": 25, "microcode": 0}]),
        ("attestation", "sev_snp_host_data", ["00" * 32]),
        ("attestation", "sev_snp_id_key_digests", ["00" * 48]),
        ("attestation", "sev_snp_author_key_digests", ["00" * 48]),
    ]


@pytest.mark.parametrize("edit", _semantic_edits(), ids=lambda edit: f"{edit[0]}.{edit[1]}")
def test_every_semantic_change_changes_the_digest(edit):
    section, key, value = edit
    assert parse_policy(with_value(section, key, value)).digest != filled_strict().digest


def test_simulation_switch_changes_the_digest():
    document = tomllib.loads(shipped_policy_path("dev").read_text())
    baseline = parse_policy(to_toml(document)).digest
    document["attestation"]["accept_unlisted_code"] = False
    assert parse_policy(to_toml(document)).digest != baseline
