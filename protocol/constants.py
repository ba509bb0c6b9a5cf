"""Header names, paths and size bounds shared across the node, the gateway and the SDK.

Each value is read on more than one side of a boundary, so a change on one side alone would break
the other; defining it here makes that impossible.
"""

from __future__ import annotations

# ----- the gateway's REST API (SDK, relay and gateway) ------------------------------------------------

# The attested directory: the gateway serves it, the relay forwards it, the SDK fetches it.
DIRECTORY_PATH = "/v1/nodes"
# The directory's format version: the gateway writes it and the SDK refuses any other, so a change of
# format is refused whole instead of being read wrongly.
DIRECTORY_VERSION = 1
# The most nodes one directory lists: the SDK refuses a longer one (it would be asked to verify
# without bound), so the gateway never publishes more.
MAX_DIRECTORY_NODES = 4096
# A request's candidates, each sealed to one node; the gateway forwards one of them.
INFER_PATH = "/v1/infer"
# The most candidates one request may carry: the gateway refuses more, and a policy may not ask
# clients for more (each candidate is one more node the gateway could choose).
MAX_CANDIDATES = 8
# A fresh evidence bundle of one node, bound to the caller's own nonce.
NODE_ATTEST_PATH = "/v1/nodes/{node_id}/attest"
# A plain RFC 9458 or chunked OHTTP request for one node, from any standard OHTTP client.
NODE_OHTTP_PATH = "/v1/nodes/{node_id}/ohttp"
# What a node id in those paths looks like: the gateway accepts no other, and the relay forwards no other.
NODE_ID_PATTERN = r"^[0-9a-f]{16,64}$"
# The node that served a request: the gateway sets it on every relayed answer, the relay passes it
# on, the SDK reports it as the route; the node also names itself under it inside its sealed answer.
NODE_ID_HEADER = "veil-node-id"

# ----- sizes -----------------------------------------------------------------------------------------

# The largest OHTTP encapsulation a node opens. The gateway refuses a larger one itself with 413:
# sent on, it would meet the node's refusal or gRPC's RESOURCE_EXHAUSTED, which reads as "busy".
MAX_ENCAPSULATED_BYTES = 2 << 20
# The largest gRPC message of the node's service, either way (an encapsulation at its bound and the
# message's framing fit with room to spare). The node's server and the gateway's channel use the same
# bound, so the gateway neither sends what the node would refuse nor waits for what it cannot send.
MAX_GRPC_MESSAGE_BYTES = 4 << 20
# The largest inner request body (the OpenAI-style JSON) a node accepts. The SDK's local proxy refuses
# a larger one at once rather than seal a request the node will refuse.
MAX_INNER_BODY_BYTES = 1 << 20

# ----- what a node's models do ------------------------------------------------------------------------

# A node's task (`veil node --task`): the node states it at attestation, the directory publishes it, the
# SDK draws an embeddings request's candidates among "embed" nodes and any other among "generate" ones.
TASK_GENERATE = "generate"
TASK_EMBED = "embed"
MODEL_TASKS = (TASK_GENERATE, TASK_EMBED)
