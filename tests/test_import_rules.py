"""Which of the repository's packages may import which, read from the source without importing it.

`veil` is the composition root: the command line and the local fleet, which start every process
and assemble the SDK (`client`) for users. The SDK is a library: no package but `veil` imports it,
and it imports nothing of `veil`, so a user of the SDK loads neither the command line nor the fleet.
Tests and benchmarks stand outside the graph and may import anything.

`module_imports` lists what each module imports; a rule is a few lines over `importers_of`.
Imports made by name at run time (`importlib.import_module("engine.cli")`) are not seen.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

OUTSIDE_THE_GRAPH = frozenset({"tests", "benchmarks"})


@dataclass(frozen=True, slots=True)
class ModuleImports:
    """One module and every module it imports, at any depth of its code (functions and TYPE_CHECKING too)."""

    name: str  # dotted, as Python knows it: "client.sdk", "veil" for veil/__init__.py
    imports: frozenset[str]  # absolute; a name imported from a package is listed as "package.name" too

    @property
    def package(self) -> str:
        return self.name.split(".")[0]

    def imported_from(self, package: str) -> list[str]:
        """What this module imports of `package`, sorted."""
        return sorted(name for name in self.imports if name == package or name.startswith(f"{package}."))


def packages(root: Path = REPO_ROOT) -> list[str]:
    """The top-level packages of the repository (folders with an __init__.py), tests and benchmarks aside."""
    return sorted(path.parent.name for path in root.glob("*/__init__.py") if path.parent.name not in OUTSIDE_THE_GRAPH)


@cache
def module_imports(package: str, root: Path = REPO_ROOT) -> tuple[ModuleImports, ...]:
    """Every module of `package` under `root`, with what it imports."""
    modules = []
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        modules.append(ModuleImports(name, frozenset(_imported(tree, name, is_package))))
    return tuple(modules)


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    # The package a relative import starts from: the module itself for an __init__.py, else its parent.
    here = module.split(".") if is_package else module.split(".")[:-1]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def importers_of(package: str, root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """Each module of another package that imports something of `package`, and what."""
    found = {}
    for other in packages(root):
        if other == package:
            continue
        for module in module_imports(other, root):
            if imported := module.imported_from(package):
                found[module.name] = imported
    return found


# ----- the rules ---------------------------------------------------------------------------------------


def test_nothing_imports_the_sdk_but_veil() -> None:
    importers = importers_of("client")
    assert {name.split(".")[0] for name in importers} == {"veil"}, importers


def test_the_sdk_imports_nothing_of_veil() -> None:
    imports = {module.name: module.imported_from("veil") for module in module_imports("client")}
    assert len(imports) > 5
    assert {name: found for name, found in imports.items() if found} == {}


def test_nothing_imports_the_composition_root() -> None:
    assert importers_of("veil") == {}


def test_the_packages_are_the_owners_folders_and_veil() -> None:
    assert {"attestation", "audit", "client", "enclave", "engine", "gateway", "issuer", "kernels", "ohttp", "policy",
            "relay", "serving", "transparency", "veil"} <= set(packages())


# ----- the reader the rules rely on -------------------------------------------------------------------


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_every_kind_of_import_is_seen(tmp_path: Path) -> None:
    """Plain, from, relative, inside a function and under TYPE_CHECKING: each is an edge the rules check."""
    _write(tmp_path, "lib/__init__.py", "from .core import run\nfrom . import tools\n")
    _write(tmp_path, "lib/core.py", "import app.fleet as fleet\nfrom app import cli\n")
    _write(tmp_path, "lib/sub/__init__.py", "from .. import core\n")
    _write(tmp_path, "lib/sub/deep.py", "from ..core import run\n\ndef late():\n    from app.fleet import Fleet\n")
    _write(tmp_path, "lib/typed.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app import Root\n")
    _write(tmp_path, "app/__init__.py", "")
    _write(tmp_path, "tests/__init__.py", "import lib\n")
    modules = module_imports("lib", tmp_path)
    imports = {module.name: module.imported_from("app") for module in modules}
    assert imports == {"lib": [], "lib.core": ["app", "app.cli", "app.fleet"], "lib.sub": [],
                       "lib.sub.deep": ["app.fleet", "app.fleet.Fleet"], "lib.typed": ["app", "app.Root"]}
    assert {module.name: module.imported_from("lib") for module in modules} == {
        "lib": ["lib", "lib.core", "lib.core.run", "lib.tools"], "lib.core": [], "lib.sub": ["lib", "lib.core"],
        "lib.sub.deep": ["lib.core", "lib.core.run"], "lib.typed": []}
    assert packages(tmp_path) == ["app", "lib"]
    assert importers_of("app", tmp_path) == {name: found for name, found in imports.items() if found}
    assert importers_of("lib", tmp_path) == {}


# ----- the whole graph ---------------------------------------------------------------------------------

# Every edge the packages may have. An edge not listed is forbidden; each line says why its edges exist.
ALLOWED_IMPORTS: dict[str, frozenset[str]] = {
    "protocol": frozenset(),  # what both sides of the node's wire agree on; depends on nothing of ours
    "ohttp": frozenset(),  # wire formats and HPKE; knows nothing of models, nodes, attestation or routing
    "kernels": frozenset(),  # tensors in, tensors out: no engine
    "audit": frozenset(),  # typed events and reports over them: no engine, no content
    "policy": frozenset({"protocol"}),  # bounds it validates are the protocol's
    "attestation": frozenset({"ohttp", "policy"}),  # key configurations in evidence; what a policy allows
    "engine": frozenset({"kernels"}),  # the model's compute; nothing of wire, routing or attestation
    "enclave": frozenset({"attestation", "audit", "engine", "ohttp", "policy", "protocol"}),  # the node
    # How every party's HTTP server serves (uvicorn options, error shapes, probes, metrics, the OHTTP
    # requests it checks); no party owns it, and it imports none of them.
    "serving": frozenset({"audit", "ohttp", "protocol"}),
    # The parties, one package each, none importing another's: the gateway sees requests, never addresses
    # or accounts (never the engine or the node either); the relay sees addresses, and knows of the gateway
    # only the paths of its REST API (`protocol`); the issuer sees accounts.
    "gateway": frozenset({"attestation", "audit", "ohttp", "policy", "protocol", "serving"}),
    "relay": frozenset({"audit", "protocol", "serving"}),
    # The one edge between parties' packages: the issuer appends the token keys it publishes to the
    # operator's log, through the log's own writing code, as `veil log append` does; the log knows no issuer.
    "issuer": frozenset({"attestation", "audit", "ohttp", "serving", "transparency"}),
    # The log server, the witness and the monitor, over attestation.transparency's formats (which the
    # SDK and the node read too, so they stay in attestation, apart from any server).
    "transparency": frozenset({"attestation", "audit", "policy", "serving"}),
    "client": frozenset({"attestation", "ohttp", "policy", "protocol"}),  # the SDK verifies and seals
    "veil": frozenset({"attestation", "audit", "client", "engine", "enclave", "gateway", "issuer", "kernels",
                       "ohttp", "policy", "protocol", "relay", "serving", "transparency"}),  # starts everything
}

PARTIES = ("gateway", "relay", "issuer", "transparency")
# The edges between parties' packages the design allows (each is explained in ALLOWED_IMPORTS).
BETWEEN_PARTIES = frozenset({("issuer", "transparency")})


def package_edges(package: str) -> dict[str, list[str]]:
    """Each other package `package` imports, with the modules of `package` that do."""
    ours = set(packages())
    edges: dict[str, list[str]] = {}
    for module in module_imports(package):
        for target in sorted({name.split(".")[0] for name in module.imports} & ours - {package}):
            edges.setdefault(target, []).append(module.name)
    return edges


def test_every_package_is_in_the_graph() -> None:
    assert set(packages()) == set(ALLOWED_IMPORTS)


@pytest.mark.parametrize("package", sorted(ALLOWED_IMPORTS))
def test_a_package_imports_only_what_the_graph_allows(package: str) -> None:
    forbidden = {target: importers for target, importers in package_edges(package).items()
                 if target not in ALLOWED_IMPORTS[package]}
    assert forbidden == {}, f"{package} must not import {sorted(forbidden)}"


@pytest.mark.parametrize(("package", "target"), [
    ("engine", "ohttp"), ("engine", "gateway"), ("engine", "client"), ("engine", "enclave"),
    ("kernels", "engine"), ("gateway", "engine"), ("gateway", "enclave"), ("ohttp", "attestation"),
    ("audit", "engine"), ("protocol", "enclave"), ("client", "veil"), ("enclave", "client"),
    ("relay", "gateway"), ("issuer", "gateway"), ("issuer", "relay"), ("gateway", "relay"), ("gateway", "issuer"),
    ("gateway", "transparency"), ("transparency", "gateway"), ("transparency", "issuer"),
    ("serving", "gateway"), ("serving", "relay"), ("serving", "issuer"), ("serving", "transparency"),
])
def test_the_edges_the_design_forbids_are_not_allowed(package: str, target: str) -> None:
    """The graph above cannot grow one of these by accident: each is a design rule, not a current fact."""
    assert target not in ALLOWED_IMPORTS[package]


def test_no_partys_package_imports_another_partys_but_the_issuer_logging_its_keys() -> None:
    """A relay operator must be able to read what it runs without the gateway's code, and so must each party."""
    edges = {(package, target) for package in PARTIES for target in ALLOWED_IMPORTS[package] if target in PARTIES}
    assert edges == BETWEEN_PARTIES
    found = {(package, target) for package in PARTIES for target in package_edges(package) if target in PARTIES}
    assert found == BETWEEN_PARTIES


def private_imports(root: Path = REPO_ROOT) -> list[str]:
    """Imports of another of our packages' private parts: a name or module starting with one underscore."""
    ours = set(packages(root))
    found = []
    for package in ours:
        for module in module_imports(package, root):
            for name in sorted(module.imports):
                parts = name.split(".")
                if parts[0] == package or parts[0] not in ours:
                    continue
                if any(part.startswith("_") and not part.startswith("__") for part in parts):
                    found.append(f"{module.name} imports {name}")
    return sorted(found)


def test_no_module_imports_another_packages_private_parts() -> None:
    assert private_imports() == []


def test_the_node_uses_only_the_engines_public_surface() -> None:
    """The enclave reaches the engine through the names `engine/__init__.py` exports, never its modules."""
    import engine

    public = {"engine", *(f"engine.{name}" for name in engine.__all__)}
    for module in module_imports("enclave"):
        assert set(module.imported_from("engine")) <= public, module.name


def test_the_rules_see_a_forbidden_edge_and_a_private_import(tmp_path: Path) -> None:
    _write(tmp_path, "kernels/__init__.py", "from engine.core import _secret\nimport grpc._utilities\n")
    _write(tmp_path, "engine/__init__.py", "from engine import _own\n")
    edges = {module.name: module.imported_from("engine") for module in module_imports("kernels", tmp_path)}
    assert edges == {"kernels": ["engine.core", "engine.core._secret"]}
    assert private_imports(tmp_path) == ["kernels imports engine.core._secret"]  # not its own, not a library's
