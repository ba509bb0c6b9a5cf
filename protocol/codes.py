"""Error codes one side answers (`{"error": {"code": ...}}`) and the other acts on.

Only a code some other side reads is here; a code only ever shown to a person stays with its owner.
"""

from __future__ import annotations

# ----- the gateway's, which the SDK reads ------------------------------------------------------------

# None of the request's candidates is an admitted, healthy node: nothing was sent to a node, so the
# SDK fetches the directory again and retries once.
NO_CANDIDATE = "no_candidate"
# Every node tried failed before accepting the request: no node read it, so the SDK retries once.
NODE_FAILED = "node_failed"
# The node does not hold the key the request was sealed to (rotated away): it read nothing, so the
# SDK retries once with a fresh directory, and tells the caller what to do if that fails too.
UNKNOWN_KEY = "unknown_key"
# The node could not decrypt the request: the SDK tells the caller that sending the same bytes again
# cannot help.
UNDECRYPTABLE = "undecryptable"
# The node did not accept the request in time and may still run it: the SDK tells the caller that
# sending it again may run it twice.
NODE_TIMEOUT = "node_timeout"

# ----- the node's, inside its sealed answer, which the SDK reads --------------------------------------

# The request's Date is too far from the node's clock; the answer carries the node's Date, so the SDK
# seals the request again once with its clock corrected by the difference.
DATE_OUT_OF_WINDOW = "date_out_of_window"
