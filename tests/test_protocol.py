"""The protocol the node, the gateway and the SDK share: generated code is reproducible, the node's
service exposes nothing else, and the package stands on its own."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from grpc_tools import protoc

from protocol import node_pb2
from protocol.generate import PROTO, protoc_arguments

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = REPO_ROOT / "protocol"
GENERATED = ("node_pb2.py", "node_pb2_grpc.py")
# Every other top-level package of the repository: the protocol may import none of them.
OTHER_PACKAGES = frozenset(path.parent.name for path in REPO_ROOT.glob("*/__init__.py")) - {"protocol"}


def test_generated_modules_match_a_fresh_generation(tmp_path: Path) -> None:
    (tmp_path / PROTO).parent.mkdir(parents=True)
    shutil.copy(REPO_ROOT / PROTO, tmp_path / PROTO)
    assert protoc.main(protoc_arguments(tmp_path)) == 0
    for name in GENERATED:
        fresh = (tmp_path / PROTO).parent / name
        assert fresh.read_text() == (PROTOCOL / name).read_text(), f"{name} is stale: run python -m protocol.generate"


def test_the_generated_modules_import_each_other_from_the_protocol_package() -> None:
    assert "from protocol import node_pb2" in (PROTOCOL / "node_pb2_grpc.py").read_text()
    assert node_pb2.DESCRIPTOR.name == PROTO


def test_the_service_has_only_attest_infer_and_health() -> None:
    service = node_pb2.DESCRIPTOR.services_by_name["Node"]
    assert sorted(method.name for method in service.methods) == ["Attest", "Health", "Infer"]
    assert list(node_pb2.DESCRIPTOR.services_by_name) == ["Node"]
    # The wire name of the service, which node and gateway of different releases must agree on.
    assert service.full_name == "veil.node.v1.Node"


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_protocol_imports_no_other_veil_package() -> None:
    modules = sorted(PROTOCOL.rglob("*.py"))
    assert len(modules) >= 5 and {"enclave", "gateway", "client"} <= OTHER_PACKAGES
    for path in modules:
        found = _top_level_imports(path) & OTHER_PACKAGES
        assert not found, f"{path.relative_to(REPO_ROOT)} imports {sorted(found)}"
