"""Cluster DNS for the processes tests/test_ops_k8s.py launches from the manifests (loaded as `sitecustomize`).

A name listed in $VEIL_TEST_CLUSTER_DNS (JSON: name -> loopback addresses, as the launcher assigned
them to the pods a Service selects) resolves to those addresses; every other name resolves as usual.
Nothing else of the process changes: its command line and its options are the manifests' own.
"""

from __future__ import annotations

import json
import os
import socket

_NAMES: dict[str, list[str]] = json.loads(os.environ.get("VEIL_TEST_CLUSTER_DNS", "{}"))
_system_getaddrinfo = socket.getaddrinfo


def _getaddrinfo(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
    name = host.decode() if isinstance(host, bytes) else host
    addresses = _NAMES.get(name.rstrip(".")) if isinstance(name, str) else None
    if addresses is None:
        return _system_getaddrinfo(host, port, *args, **kwargs)
    if not addresses:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return [info for address in addresses for info in _system_getaddrinfo(address, port, *args, **kwargs)]


if _NAMES:
    socket.getaddrinfo = _getaddrinfo
