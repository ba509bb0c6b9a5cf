"""SECURITY.md cannot drift from the code: every test it cites exists, every section is there.

Two kinds of tests live here. The first kind reads SECURITY.md: each reference written as
`tests/test_x.py::test_name` must name a test function defined in that module (found with `ast`,
without importing it; a parametrized test is cited by its bare name), each code path it names must
exist, and the threat model must have its five attackers and five requirements, each citing tests.
The second kind checks claims SECURITY.md makes that no other module's tests cover: structural
facts about the code (what the gateway imports, what serving code may print) and documented
limits (no replay protection in OHTTP, capacities that are the gateway's word), so that fixing a
limit fails a test here and the document is corrected with it.
"""

from __future__ import annotations

import ast
import re
import random
import secrets
import time
from functools import cache
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SECURITY_MD = REPO_ROOT / "SECURITY.md"
PACKAGES = ("ohttp", "attestation", "policy", "engine", "kernels", "enclave", "gateway", "audit", "client",
            "protocol")

# `tests/test_x.py::test_name`, optionally with a parametrization id that is ignored.
TEST_REFERENCE = re.compile(r"(tests/test_[A-Za-z0-9_]+\.py)::(test_[A-Za-z0-9_]+)(?:\[[^\]\s]*\])?")
TEST_FILE_REFERENCE = re.compile(r"(?<![\w/])(tests/[A-Za-z0-9_]+\.py)(?!::)")
CODE_PATH = re.compile(r"`((?:%s)/[A-Za-z0-9_./*-]+)`" % "|".join(PACKAGES))

ATTACKERS = ("A curious operator", "A compromised node", "A compromised gateway", "A network observer",
             "Another tenant")
REQUIREMENTS = ("Stateless computation", "Enforceable guarantees", "Non-targetability",
                "No privileged runtime access", "Verifiable transparency")
TOP_SECTIONS = ("What Veil promises", "Threat model", "The five requirements", "Optimizations",
                "Attestation", "Memory hygiene", "Side channels that remain", "Non-targetability, measured",
                "Hostile input", "What is not done yet", "Reporting a vulnerability")


# ----- reading SECURITY.md ------------------------------------------------------------------------


@cache
def document() -> str:
    return SECURITY_MD.read_text(encoding="utf-8")


def sections(level: int) -> dict[str, str]:
    """Heading text (without a leading number) -> the text up to the next heading of that level or above."""
    heading = re.compile(rf"^{'#' * level} (?:\d+\.\s+)?(.+)$", re.MULTILINE)
    same_or_higher = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE)
    text = document()
    result = {}
    for match in heading.finditer(text):
        following = same_or_higher.search(text, match.end())
        result[match.group(1).strip()] = text[match.end():following.start() if following else len(text)]
    return result


def section_named(level: int, title: str) -> str:
    matching = [text for heading, text in sections(level).items() if heading.startswith(title)]
    assert len(matching) == 1, f"SECURITY.md needs exactly one level-{level} section starting with {title!r}"
    return matching[0]


@cache
def functions_defined(module: Path) -> frozenset[str]:
    tree = ast.parse(module.read_text(encoding="utf-8"), filename=str(module))
    return frozenset(node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def missing_tests(text: str, root: Path = REPO_ROOT) -> list[str]:
    """Every `tests/test_x.py::test_name` in `text` that does not name a test function in that file."""
    missing = []
    for path, name in TEST_REFERENCE.findall(text):
        module = root / path
        if not module.is_file() or name not in functions_defined(module):
            missing.append(f"{path}::{name}")
    return missing


# ----- the document ----------------------------------------------------------------------------------


def test_security_md_cites_tests() -> None:
    assert len(TEST_REFERENCE.findall(document())) >= 80


def test_every_cited_test_exists() -> None:
    assert missing_tests(document()) == []


def test_every_cited_test_file_exists() -> None:
    missing = [path for path in TEST_FILE_REFERENCE.findall(document()) if not (REPO_ROOT / path).is_file()]
    assert missing == []


def test_the_reference_check_catches_a_missing_test(tmp_path: Path) -> None:
    """The check above can fail: a renamed test, a wrong file, a missing file."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_here.py").write_text("def test_present():\n    pass\n")
    text = ("`tests/test_here.py::test_present`, `tests/test_here.py::test_present[case-1]`, "
            "`tests/test_here.py::test_renamed`, `tests/test_gone.py::test_present`")
    assert missing_tests(text, tmp_path) == ["tests/test_here.py::test_renamed", "tests/test_gone.py::test_present"]


def test_every_cited_code_path_exists() -> None:
    paths = set(CODE_PATH.findall(document()))
    assert len(paths) >= 30
    missing = [path for path in sorted(paths) if not list(REPO_ROOT.glob(path))]
    assert missing == []


@pytest.mark.parametrize("title", TOP_SECTIONS)
def test_every_top_section_exists(title: str) -> None:
    assert section_named(2, title).strip()


@pytest.mark.parametrize("attacker", ATTACKERS)
def test_every_attacker_has_a_section_that_cites_tests(attacker: str) -> None:
    text = section_named(3, attacker)
    assert "**Can**" in text and "**Cannot**" in text
    assert len(TEST_REFERENCE.findall(text)) >= 3


@pytest.mark.parametrize("requirement", REQUIREMENTS)
def test_every_requirement_maps_to_code_and_tests(requirement: str) -> None:
    text = section_named(3, requirement)
    assert len(CODE_PATH.findall(text)) >= 2
    assert len(TEST_REFERENCE.findall(text)) >= 3


def test_every_forbidden_optimization_and_known_gap_is_explained() -> None:
    from policy.forbidden import KNOBS
    from policy.model import KNOWN_GAPS

    optimizations = section_named(2, "Optimizations")
    for knob in KNOBS:
        assert f"`{knob.section}.{knob.key}`" in optimizations, f"{knob.section}.{knob.key} is not in the table"
    attestation = section_named(2, "Attestation")
    for gap in KNOWN_GAPS:
        assert f"`{gap}`" in attestation, f"the accepted gap {gap} is not explained"


# ----- claims no other module checks --------------------------------------------------------------


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_gateway_imports_nothing_that_can_decrypt() -> None:
    """The gateway reads OHTTP media types and Privacy Pass tokens only: no HPKE, no key, no opener, and
    nothing of the node's code (it calls the node through `protocol`)."""
    allowed = {"ohttp.media_types"}
    for path in sorted((REPO_ROOT / "gateway").rglob("*.py")):
        for module in imported_modules(path):
            top = module.split(".")[0]
            if top in ("ohttp", "enclave", "engine", "kernels", "client"):
                privacy_pass = module == "ohttp.privacypass" or module.startswith("ohttp.privacypass.")
                assert module in allowed or privacy_pass, f"{path.relative_to(REPO_ROOT)} imports {module}"


def test_privacy_pass_uses_no_other_part_of_ohttp() -> None:
    """ohttp.privacypass (blind signatures and token formats) reaches no HPKE or OHTTP code of its own package."""
    for path in sorted((REPO_ROOT / "ohttp" / "privacypass").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level in (0, 1), f"{path.name} imports from outside ohttp.privacypass"
                assert node.level == 1 or not (node.module or "").startswith("ohttp"), path.name


# protoc's output, regenerated rather than written (tests/test_protocol.py checks it is unedited).
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py")


def test_serving_code_neither_prints_nor_logs() -> None:
    """Outside the command-line modules, the packages a node runs have no print call and no logger."""
    checked = 0
    for package in ("engine", "kernels", "ohttp", "enclave", "attestation", "policy", "protocol"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if path.name == "cli.py" or path.name.endswith(GENERATED_SUFFIXES):
                continue
            checked += 1
            tree = ast.parse(path.read_text(encoding="utf-8"))
            calls = {node.func.id for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
            where = path.relative_to(REPO_ROOT)
            assert "print" not in calls and "breakpoint" not in calls, f"{where} prints"
            assert not {"logging", "traceback", "pdb"} & imported_modules(path), f"{where} logs"
    assert checked > 40


def test_the_node_service_offers_attest_infer_and_health_only() -> None:
    from protocol import node_pb2

    services = node_pb2.DESCRIPTOR.services_by_name
    assert list(services) == ["Node"]
    assert [method.name for method in services["Node"].methods] == ["Attest", "Infer", "Health"]


def test_strict_admits_no_node_until_a_release_is_listed(tmp_path: Path) -> None:
    """Under `strict` the measurement check refuses every code digest; listing the release admits it."""
    import datetime as dt

    from attestation import checks
    from attestation.backends.sim import SimBackend
    from attestation.errors import MeasurementNotAllowedError
    from attestation.measurement import Measurement
    from ohttp import generate_key_pair
    from tests.policy_support import filled_strict, filled_strict_text
    from tests.test_attestation_support import RECEIPT_KEY
    from policy import parse_policy

    strict = filled_strict()
    assert strict.attestation.allowed_code_digests == () and not strict.attestation.accept_unlisted_code
    assert strict.engine.allowed_model_digests == () and not strict.engine.accept_unlisted_models
    code, model = secrets.token_bytes(32), secrets.token_bytes(32)
    released = parse_policy(filled_strict_text()
                            .replace("allowed_code_digests = []", f'allowed_code_digests = ["{code.hex()}"]')
                            .replace("allowed_model_digests = []", f'allowed_model_digests = ["{model.hex()}"]'))
    backend = SimBackend(tmp_path / "sim-root")
    config = generate_key_pair(1).config.encode()

    def measurement_check(policy) -> str:
        bundle = backend.collect(config, Measurement(code, policy.digest, model), secrets.token_bytes(32), RECEIPT_KEY)
        now = time.time()
        context = checks.Context(bundle, policy, now, None, dt.datetime.fromtimestamp(now, dt.timezone.utc))
        return checks.check_measurement(context)

    with pytest.raises(MeasurementNotAllowedError):
        measurement_check(strict)
    assert "listed" in measurement_check(released)


def test_a_replayed_encapsulated_request_opens_again() -> None:
    """RFC 9458 has no replay protection and nodes keep no replay cache: the same bytes open twice.

    Each opening seals its answer under a fresh response nonce, readable only by the original client."""
    from ohttp import ClientRequest, KeyRing, decapsulate_request, generate_key_pair

    ring = KeyRing(generate_key_pair(4))
    encapsulated, client = ClientRequest.encapsulate(ring.current.config, b"the same request")
    first_plaintext, first = decapsulate_request(ring, encapsulated)
    second_plaintext, second = decapsulate_request(ring, encapsulated)
    assert first_plaintext == second_plaintext == b"the same request"
    first_answer, second_answer = first.seal_response(b"answer"), second.seal_response(b"answer")
    assert first_answer != second_answer
    assert client.open_response(first_answer) == client.open_response(second_answer) == b"answer"


def test_a_directory_capacity_is_the_gateways_word_not_attested(tmp_path: Path) -> None:
    """The client verifies a candidate's evidence, key and id, but its capacity is not in the evidence:
    a directory can list any capacity for a genuine node, and sampling weighs by it."""
    from attestation.backends.sim import SimBackend
    from attestation.measurement import Measurement
    from attestation.sim_root import ROOT_DIR_ENV
    from attestation.verifier import node_id_for
    from client.directory import DirectoryEntry, capped, sample_candidates
    from client.verify import CandidateVerifier
    from tests.test_attestation_support import RECEIPT_KEY
    from ohttp import generate_key_pair
    from policy import shipped_policy

    dev = shipped_policy("dev")
    root = tmp_path / "sim-root"
    config = generate_key_pair(1).config.encode()
    measurement = Measurement(secrets.token_bytes(32), dev.digest, secrets.token_bytes(32))
    evidence = SimBackend(root).collect(config, measurement, secrets.token_bytes(32), RECEIPT_KEY).to_json()
    node_id = node_id_for(config, measurement)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ROOT_DIR_ENV, str(root))
        records = [CandidateVerifier(dev).check(DirectoryEntry(node_id, config, evidence, capacity))
                   for capacity in (1, 1_000_000)]
    assert all(record.ok for record in records)
    assert [record.capacity for record in records] == [1, 1_000_000]
    inflated = DirectoryEntry(node_id, config, evidence, 1_000_000)
    others = [DirectoryEntry(f"{index:032x}", config, evidence, 10) for index in range(20)]
    assert all(inflated in sample_candidates([inflated, *others], 3) for _ in range(50))
    # What bounds the claim: the client counts no capacity above its policy's max_node_capacity.
    rng = random.Random(9)
    fair = capped([inflated, *others], dev.routing.max_node_capacity)
    assert fair[0].capacity == dev.routing.max_node_capacity == 64
    included = sum(fair[0] in sample_candidates(fair, 3, rng) for _ in range(400))
    assert 0.6 * 400 < included < 0.85 * 400  # 3 * 64 / 264 = 0.73 of candidate sets, not all of them
