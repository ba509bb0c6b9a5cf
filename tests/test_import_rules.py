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
    assert {"attestation", "audit", "client", "enclave", "engine", "gateway", "kernels", "ohttp", "policy",
            "veil"} <= set(packages())


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
