"""The node's exceptions. Messages never carry request content or key material."""


class NodeError(Exception):
    """Base class for node errors."""


class SelfCheckError(NodeError):
    """The node refuses to start: its configuration or platform breaks the policy."""


class OverloadedError(NodeError):
    """The node is at capacity; the gateway should try another node."""
