"""The node's gRPC surface: generated code is reproducible, and the service exposes nothing else."""

from __future__ import annotations

import shutil
from pathlib import Path

from grpc_tools import protoc

from enclave.proto import node_pb2

REPO_ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("node_pb2.py", "node_pb2_grpc.py")


def test_generated_modules_match_a_fresh_generation(tmp_path: Path) -> None:
    source = tmp_path / "enclave" / "proto"
    source.mkdir(parents=True)
    shutil.copy(REPO_ROOT / "enclave" / "proto" / "node.proto", source / "node.proto")
    status = protoc.main(
        ["grpc_tools.protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         "enclave/proto/node.proto"]
    )
    assert status == 0
    for name in GENERATED:
        committed = (REPO_ROOT / "enclave" / "proto" / name).read_text()
        assert (source / name).read_text() == committed, f"{name} is stale: run python -m enclave.proto.generate"


def test_the_service_has_only_attest_infer_and_health() -> None:
    service = node_pb2.DESCRIPTOR.services_by_name["Node"]
    assert sorted(method.name for method in service.methods) == ["Attest", "Health", "Infer"]
    assert list(node_pb2.DESCRIPTOR.services_by_name) == ["Node"]
