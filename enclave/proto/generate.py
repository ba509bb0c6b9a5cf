"""Regenerates node_pb2.py and node_pb2_grpc.py from node.proto (reproducibly, with grpcio-tools)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    from grpc_tools import protoc

    return protoc.main(
        ["grpc_tools.protoc", f"-I{REPO_ROOT}", f"--python_out={REPO_ROOT}", f"--grpc_python_out={REPO_ROOT}",
         "enclave/proto/node.proto"]
    )


if __name__ == "__main__":
    sys.exit(main())
