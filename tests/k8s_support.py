"""Reading deploy/k8s as kustomize builds it, and launching its containers' command lines on loopback.

`build(overlay)` renders a kustomization the way `kustomize build` does for what these manifests
use: resources (files and folders), strategic-merge patches (maps merged, a null deletes a key,
lists of named items merged by `name`, volume mounts by `mountPath`) and image tags.

`PodLauncher` runs a container exactly as its manifest writes it (the image's entrypoint, `veil`,
then `args`; `command` where the manifest gives one), with three substitutions a cluster would
make and loopback cannot: the pod's IP (`status.podIP`) is a loopback address of its own, each
volume's mount path is a folder (a ConfigMap's files written there as the manifest gives them),
and cluster DNS names resolve, through `tests/k8s_dns/sitecustomize.py`, to the loopback pods a
Service selects.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import HANG_S, REPO_ROOT

K8S = REPO_ROOT / "deploy" / "k8s"
DNS_SHIM = Path(__file__).parent / "k8s_dns"
CLUSTER_DNS_ENV = "VEIL_TEST_CLUSTER_DNS"
# The key each kind of list is merged by, as Kubernetes' strategic merge does for these fields.
_MERGE_KEYS = ("name", "mountPath")


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def build(folder: Path) -> list[dict[str, Any]]:
    """The resources `kustomize build folder` gives."""
    kustomization = documents(folder / "kustomization.yaml")[0]
    resources: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        target = (folder / entry).resolve()
        resources += build(target) if target.is_dir() else documents(target)
    for patch in kustomization.get("patches", []):
        for document in documents(folder / patch["path"]):
            target = _find(resources, document)
            resources[resources.index(target)] = merge(target, document)
    for image in kustomization.get("images", []):
        for container in containers(resources):
            if container["image"] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return resources


def _find(resources: list[dict[str, Any]], patch: dict[str, Any]) -> dict[str, Any]:
    key = (patch["kind"], patch["metadata"]["name"], patch["metadata"].get("namespace"))
    matches = [r for r in resources if (r["kind"], r["metadata"]["name"], r["metadata"].get("namespace")) == key]
    assert len(matches) == 1, f"a patch names {key}, which the resources hold {len(matches)} times"
    return matches[0]


def merge(base: Any, patch: Any) -> Any:
    """A strategic merge of `patch` into `base` (a new value; neither is changed)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = merge(merged[key], value) if key in merged else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list):
        key = next((k for k in _MERGE_KEYS if all(isinstance(i, dict) and k in i for i in base + patch)), None)
        if key is None:
            return copy.deepcopy(patch)
        merged = copy.deepcopy(base)
        for item in patch:
            index = next((n for n, old in enumerate(merged) if old[key] == item[key]), None)
            if index is None:
                merged.append(copy.deepcopy(item))
            else:
                merged[index] = merge(merged[index], item)
        return merged
    return copy.deepcopy(patch)


def pod_specs(resources: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod spec) for every workload that runs pods."""
    return [(r, r["spec"]["template"]["spec"]) for r in resources
            if r["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def containers(resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for _, spec in pod_specs(resources) for c in spec.get("containers", []) + spec.get("initContainers", [])]


def named(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name)


def image_entrypoint() -> list[str]:
    """The Containerfile's ENTRYPOINT (exec form)."""
    for line in (REPO_ROOT / "deploy" / "Containerfile").read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            return json.loads(line.removeprefix("ENTRYPOINT "))
    raise AssertionError("the Containerfile has no ENTRYPOINT")


# ----- launching on loopback -------------------------------------------------------------------


@dataclass
class Pod:
    """One replica of a workload, launched: its loopback IP, its process and where its output goes."""

    workload: str
    namespace: str
    labels: dict[str, str]
    ip: str
    process: subprocess.Popen | None = None
    log: Path | None = None

    def last_words(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log and self.log.exists() else ""


@dataclass
class PodLauncher:
    """Launches the resources' pods on loopback, each with its own 127.x address."""

    resources: list[dict[str, Any]]
    workdir: Path
    # Folders standing for volumes a cluster provides: a Secret or a PersistentVolumeClaim, by name.
    provided: dict[str, Path]
    # Each image's entrypoint (the Containerfile's, for Veil's image), used where a container gives no command.
    entrypoints: dict[str, list[str]]
    # Where each program a command line starts with is on this machine.
    programs: dict[str, list[str]]
    subnet: str = "127.77.0."
    pods: list[Pod] = field(default_factory=list)

    def plan(self) -> None:
        """Give every replica of every workload its address (before any starts: DNS needs them all)."""
        host = 10
        for workload, _ in pod_specs(self.resources):
            for _ in range(workload["spec"].get("replicas", 1)):
                self.pods.append(Pod(workload["metadata"]["name"], workload["metadata"]["namespace"],
                                     workload["spec"]["template"]["metadata"]["labels"], f"{self.subnet}{host}"))
                host += 1

    def cluster_dns(self) -> dict[str, list[str]]:
        """Each Service's DNS names and the addresses of the pods it selects (ports equal their target ports)."""
        names = {}
        for service in (r for r in self.resources if r["kind"] == "Service"):
            namespace, selector = service["metadata"]["namespace"], service["spec"]["selector"]
            addresses = [pod.ip for pod in self.pods if pod.namespace == namespace
                         and all(pod.labels.get(k) == v for k, v in selector.items())]
            short = f"{service['metadata']['name']}.{namespace}"
            for name in (short, f"{short}.svc", f"{short}.svc.cluster.local"):
                names[name] = addresses
        return names

    def start(self, workload: str) -> list[Pod]:
        spec = next(spec for w, spec in pod_specs(self.resources) if w["metadata"]["name"] == workload)
        started = []
        for index, pod in enumerate(p for p in self.pods if p.workload == workload):
            (container,) = spec["containers"]
            argv, env = self._command_line(pod, spec, container, self.workdir / f"{workload}-{index}")
            pod.log = self.workdir / f"{workload}-{index}.log"
            with open(pod.log, "wb") as log:
                pod.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, cwd=self.workdir)
            started.append(pod)
        return started

    def stop(self) -> None:
        for pod in self.pods:
            if pod.process is not None and pod.process.poll() is None:
                pod.process.terminate()
        for pod in self.pods:
            if pod.process is not None:
                try:
                    pod.process.wait(HANG_S)
                except subprocess.TimeoutExpired:
                    pod.process.kill()

    def _command_line(self, pod: Pod, spec: dict[str, Any], container: dict[str, Any],
                      root: Path) -> tuple[list[str], dict[str, str]]:
        mounts = self._mount(spec, container, root)
        container_env = {item["name"]: self._env_value(pod, item) for item in container.get("env", [])}
        container_env = {name: relocate(value, mounts) for name, value in container_env.items()}
        command = container.get("command") or self.entrypoints[container["image"]]
        program = self.programs[command[0]]
        arguments = [relocate(expand(argument, container_env), mounts)
                     for argument in command[1:] + container.get("args", [])]
        env = dict(os.environ, **container_env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DNS_SHIM), str(REPO_ROOT),
                                                          os.environ.get("PYTHONPATH")]))
        env[CLUSTER_DNS_ENV] = json.dumps(self.cluster_dns())
        return [*program, *arguments], env

    def _env_value(self, pod: Pod, item: dict[str, Any]) -> str:
        if "value" in item:
            return str(item["value"])
        field_path = item["valueFrom"]["fieldRef"]["fieldPath"]
        assert field_path == "status.podIP", f"no loopback stand-in for {field_path}"
        return pod.ip

    def _mount(self, spec: dict[str, Any], container: dict[str, Any], root: Path) -> dict[str, Path]:
        """A folder for every volume the container mounts: mount path -> folder."""
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        mounts = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                mounts[mount["mountPath"]] = root / mount["name"]  # filled below, once every path is known
            elif "secret" in volume:
                mounts[mount["mountPath"]] = self.provided[volume["secret"]["secretName"]]
            elif "persistentVolumeClaim" in volume:
                mounts[mount["mountPath"]] = self.provided[volume["persistentVolumeClaim"]["claimName"]]
            else:
                assert "emptyDir" in volume, f"volume {mount['name']} is of a kind loopback cannot stand in for"
                mounts[mount["mountPath"]] = root / mount["name"]
                mounts[mount["mountPath"]].mkdir(parents=True, exist_ok=True)
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                config_map = named(self.resources, "ConfigMap", volume["configMap"]["name"])
                folder = mounts[mount["mountPath"]]
                folder.mkdir(parents=True, exist_ok=True)
                for name, text in config_map["data"].items():
                    (folder / name).write_text(relocate(text, mounts), encoding="utf-8")
        return mounts


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a command or argument."""
    return re.sub(r"\$\((\w+)\)", lambda found: env.get(found.group(1), found.group(0)), text)


def relocate(text: str, mounts: dict[str, Path]) -> str:
    """`text` with each mount path (where a path starts with it) replaced by the folder standing for it, in one
    pass (a folder put in place is never rewritten by a shorter mount path)."""
    if not mounts:
        return text
    paths = "|".join(re.escape(mount_path) for mount_path in sorted(mounts, key=len, reverse=True))
    return re.sub(rf"(?<![\w./-])({paths})(?=/|\"|'|\s|$)", lambda found: str(mounts[found.group(1)]), text)
