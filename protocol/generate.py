"""Regenerates node_pb2.py and node_pb2_grpc.py from node.proto (reproducibly, with grpcio-tools).

Run from anywhere as `python -m protocol.generate`; the generated modules import each other as
`protocol.node_pb2`, because protoc names them after the .proto file's path under the repository root.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO = "protocol/node.proto"


def protoc_arguments(root: Path) -> list[str]:
    """The protoc command line that writes the generated modules next to `root / PROTO`."""
    return ["grpc_tools.protoc", f"-I{root}", f"--python_out={root}", f"--grpc_python_out={root}", PROTO]


def main() -> int:
    from grpc_tools import protoc

    return protoc.main(protoc_arguments(REPO_ROOT))


if __name__ == "__main__":
    sys.exit(main())
