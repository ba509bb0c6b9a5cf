"""What the node, the gateway and the SDK must agree on, each defined once.

- `node.proto` and its generated modules (`node_pb2`, `node_pb2_grpc`): the node's gRPC service,
  which the node serves and the gateway calls; `python -m protocol.generate` regenerates them.
- `constants`: header names, paths and size bounds of the wire between the three.
- `codes`: the error codes one side answers and the other acts on.

It imports no other Veil package (only grpc and protobuf), so the gateway talks to a node without
importing the node's code, and no side's code comes along with the protocol.
"""
