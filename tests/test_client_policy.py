"""The SDK takes what it enforces from the policy it verifies with: K candidates and the strict default.

Checked against a real HTTP server that lists real simulated evidence of five nodes and records the
candidates each request is encrypted to.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from attestation.backends.sim import SimBackend
from attestation.measurement import Measurement
from attestation.sim_root import ROOT_DIR_ENV
from attestation.verifier import node_id_for
from client.errors import GatewayError
from client.sdk import Client
from ohttp import generate_key_pair
from policy import PlaceholderError, Policy, load_policy, shipped_policy_path
from tests.http_stand_in import environment, served
from tests.policy_support import filled_strict
from tests.test_attestation_support import RECEIPT_KEY
from tests.test_client_refusal import StandIn, _app

NODES = 5


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    root = tmp_path_factory.mktemp("policy-k") / "root"
    state = StandIn({"version": 1, "nodes": [], "policy_digest": ""})
    with served(_app(state)) as url, environment(ROOT_DIR_ENV, str(root)):
        state.url = url
        yield state


def _node(policy: Policy) -> dict:
    config = generate_key_pair(1).config.encode()
    measurement = Measurement(secrets.token_bytes(32), policy.digest, secrets.token_bytes(32))
    bundle = SimBackend(Path(os.environ[ROOT_DIR_ENV])).collect(config, measurement, secrets.token_bytes(32), RECEIPT_KEY)
    return {"node_id": node_id_for(config, measurement), "key_config": base64.b64encode(config).decode(),
            "evidence": bundle.to_json(), "capacity": 4, "attestation_result": ""}


def _dev_with_candidates(k: int, folder: Path, stand_in: StandIn) -> Path:
    """A dev policy with K = `k`, and a directory of nodes that run under it."""
    text = shipped_policy_path("dev").read_text()
    assert "candidates = 3" in text
    path = folder / f"dev-k{k}.toml"
    path.write_text(text.replace("candidates = 3", f"candidates = {k}"))
    policy = load_policy(path)
    stand_in.directory = {**stand_in.directory, "nodes": [_node(policy) for _ in range(NODES)]}
    return path


def _candidates_sent(stand_in: StandIn, client: Client) -> int:
    before = len(stand_in.infer_bodies)
    with pytest.raises(GatewayError):  # the stand-in answers 503 after recording the request
        client.completions.create(model="tiny", prompt="a private prompt")
    [body] = stand_in.infer_bodies[before:]
    return len(json.loads(body)["candidates"])


@pytest.mark.parametrize("k", [1, 2, 4])
def test_each_request_is_encrypted_to_the_policys_number_of_candidates(stand_in: StandIn, tmp_path: Path,
                                                                        k: int) -> None:
    policy = _dev_with_candidates(k, tmp_path, stand_in)
    assert load_policy(policy).routing.candidates == k
    with Client(stand_in.url, policy=str(policy), max_retries=0) as client:
        assert client.candidates == k
        assert _candidates_sent(stand_in, client) == k


def test_a_caller_may_ask_for_fewer_candidates_than_the_policy_never_more(stand_in: StandIn,
                                                                          tmp_path: Path) -> None:
    policy = str(_dev_with_candidates(4, tmp_path, stand_in))
    with Client(stand_in.url, policy=policy, candidates=2, max_retries=0) as client:
        assert _candidates_sent(stand_in, client) == 2
    with pytest.raises(ValueError, match="between 1 and 4.*gateway chooses"):
        Client(stand_in.url, policy=policy, candidates=5)
    with pytest.raises(ValueError, match="between 1 and 4"):
        Client(stand_in.url, policy=policy, candidates=0)


def test_the_sdk_verifies_under_strict_and_its_k_unless_told_otherwise() -> None:
    # The default is strict: as shipped, with its keys still empty, it is refused before anything is contacted.
    with pytest.raises(PlaceholderError, match=r"policy 'strict' .*transparency\.log_key"):
        Client("http://127.0.0.1:9")
    filled = filled_strict()
    with Client("http://127.0.0.1:9", policy=filled) as client:  # nothing is contacted before the first request
        assert client.policy.digest == filled.digest
        assert client.candidates == filled.routing.candidates
