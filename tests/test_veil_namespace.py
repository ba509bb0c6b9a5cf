"""`veil` is what users import: the SDK and the offline engine under one name, loaded on first use.

`import veil` stays cheap (no torch, no gateway, no command line), every public name is the very
object its own package defines, the README's example imports from `veil` alone and runs against a
real local fleet, and `python -m veil` is the command line.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import client
import engine
import veil
from tests.conftest import REPO_ROOT
from veil.fleet import Fleet, FleetSettings

README = REPO_ROOT / "README.md"
README_GATEWAY = "http://127.0.0.1:8000"  # where the README's example expects a `veil up` fleet
OWNERS = (client, engine)


def test_from_veil_import_client_is_the_sdk() -> None:
    from client.sdk import Client as SdkClient
    from veil import Client

    assert Client is SdkClient


def test_every_public_name_is_its_own_packages_object() -> None:
    assert veil.__all__ == sorted(set(veil.__all__))
    for name in veil.__all__:
        owners = [package for package in OWNERS if name in package.__all__]
        assert len(owners) == 1, f"{name} is published by {len(owners)} packages"
        assert getattr(veil, name) is getattr(owners[0], name), name


def test_the_sdk_and_the_offline_engine_are_published() -> None:
    assert set(client.__all__) <= set(veil.__all__)
    assert {"Client", "ModelNotFoundError", "ChatCompletion", "LLMEngine", "SamplingParams",
            "EngineConfig"} <= set(veil.__all__)


def test_the_version_is_the_installed_distributions() -> None:
    assert veil.__version__ == importlib.metadata.version("veil")


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Fleet'"):
        veil.Fleet


# What a fresh interpreter has loaded after `import veil`, after `from veil import Client`, and after
# asking for the engine, which is where torch comes in.
_LOADED = """
import json, sys
loaded = {}
import veil
loaded["import veil"] = sorted(sys.modules)
from veil import Client
loaded["from veil import Client"] = sorted(sys.modules)
veil.LLMEngine
loaded["veil.LLMEngine"] = sorted(sys.modules)
print(json.dumps(loaded))
"""


def _packages(modules: list[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


def test_import_veil_loads_neither_torch_nor_the_gateway() -> None:
    done = subprocess.run([sys.executable, "-c", _LOADED], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True, timeout=300)
    loaded = json.loads(done.stdout)
    for step in ("import veil", "from veil import Client"):
        assert not {"torch", "gateway", "engine", "enclave"} & _packages(loaded[step]), step
        assert not {"veil.cli", "veil.fleet", "veil.demo"} & set(loaded[step]), step
    assert "client.sdk" in loaded["from veil import Client"]
    assert {"torch", "engine"} <= _packages(loaded["veil.LLMEngine"])


def readme_sdk_example() -> str:
    """The Python block under the README's "Using it from Python" heading."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Using it from Python"):]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found, "README.md has no python example under 'Using it from Python'"
    return found.group(1)


def test_the_readme_example_imports_only_from_veil() -> None:
    tree = ast.parse(readme_sdk_example())
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports
    for node in imports:
        assert isinstance(node, ast.ImportFrom) and node.module == "veil" and node.level == 0, ast.unparse(node)
        assert {alias.name for alias in node.names} <= set(veil.__all__)


def test_python_m_veil_is_the_command_line() -> None:
    done = subprocess.run([sys.executable, "-m", "veil", "--help"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: veil")
    assert all(command in done.stdout for command in ("node", "gateway", "issuer", "relay", "demo", "chat"))


@pytest.mark.slow
def test_the_readme_example_runs_against_a_local_fleet(tmp_path: Path) -> None:
    """The example, pointed at a one-node fleet serving what `veil up` serves (the shipped model), prints an
    answer and its node."""
    example = readme_sdk_example()
    assert example.count(README_GATEWAY) == 1
    settings = FleetSettings(nodes=1, workdir=tmp_path / "fleet", torch_threads=1)
    with Fleet(settings) as fleet:
        program = example.replace(README_GATEWAY, fleet.gateway_url)
        done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**os.environ, **fleet.environment})
        assert done.returncode == 0, done.stderr[-2000:]
        served = re.search(r" served by ([0-9a-f]{16,})\n", done.stdout)
        assert served, "the example printed no answer and node"
        assert fleet.node_index(served.group(1)) == 0  # the id of the fleet's one node, as its audit file says
