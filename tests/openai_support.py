"""The real `openai` package through `veil proxy`, in front of a one-node fleet serving a given model folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from attestation.sim_root import ROOT_DIR_ENV, load_or_create_sim_root
from client.sdk import Client
from tests.test_e2e_models import _proxy
from veil.fleet import Fleet, FleetSettings


@contextmanager
def openai_through_proxy(model: Path, root: Path) -> Iterator[openai.OpenAI]:
    """An `openai.OpenAI` whose base URL is a proxy backed by the SDK, verifying the fleet under the dev policy."""
    with sdk_and_proxy(model, root) as (_, proxy_url):
        yield openai_client(proxy_url)


def openai_client(proxy_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="unused-by-veil", max_retries=0, timeout=120)


@contextmanager
def sdk_and_proxy(model: Path, root: Path, **fleet_fields) -> Iterator[tuple[Client, str]]:
    """The SDK verifying a one-node fleet under the dev policy, and the URL of a proxy it backs;
    `fleet_fields`: more `FleetSettings` (model names, node arguments)."""
    sim_root = root / "sim-root"
    load_or_create_sim_root(sim_root)
    settings = FleetSettings(nodes=1, model_dir=model, workdir=root / "fleet", sim_root_dir=sim_root, torch_threads=1,
                             **fleet_fields)
    previous_root = os.environ.get(ROOT_DIR_ENV)
    os.environ[ROOT_DIR_ENV] = str(sim_root)  # the client's dev policy trusts the fleet's simulated root
    try:
        with Fleet(settings) as fleet, Client(fleet.gateway_url, policy="dev") as sdk:
            fleet.wait_for_pool(1, timeout_s=90)
            with _proxy(sdk) as proxy_url:
                yield sdk, proxy_url
    finally:
        if previous_root is None:
            os.environ.pop(ROOT_DIR_ENV, None)
        else:
            os.environ[ROOT_DIR_ENV] = previous_root
