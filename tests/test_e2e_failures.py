"""A node dies mid-answer: its client gets a clear error, everyone else is served, the gateway evicts it.

Real processes on loopback (a gateway and three nodes), their own fleet, since this module kills one.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from client.errors import StreamTruncatedError
from client.sdk import Client
from engine.tiny import write_tiny_model
from tests.fleet_support import running_fleet
from veil.fleet import Fleet, FleetSettings

pytestmark = pytest.mark.slow
MODEL = "tiny-model"
# With ignore_eos this prompt runs the full 400 tokens on any machine (a seed fixes the draws only for the
# same logits, and another CPU may round them otherwise):
# the answer is still streaming when its node is killed.
LONG_PROMPT, LONG_SEED, LONG_TOKENS = "The story goes", 0, 400


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("e2e-failures")
    settings = FleetSettings(nodes=3, model_dir=write_tiny_model(root / MODEL), workdir=root / "fleet",
                             torch_threads=1, reattest_s=2, health_s=1)
    with running_fleet(settings) as running:
        yield running


def test_a_node_killed_mid_stream_fails_its_client_clearly_and_is_evicted(fleet: Fleet) -> None:
    with Client(fleet.gateway_url, policy="dev") as client:
        stream = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=LONG_TOKENS,
                                           temperature=1.0, seed=LONG_SEED, ignore_eos=True, stream=True)
        first = next(stream)
        assert first.choices
        victim = stream.route.node_id
        fleet.kill_node(fleet.node_index(victim))
        with pytest.raises(StreamTruncatedError) as caught:
            for _ in stream:
                pass
        assert victim[:16] in str(caught.value) and "cut off" in str(caught.value)

        # Everyone else is still served, whether or not their directory still lists the dead node.
        for attempt in range(8):
            answer = client.completions.create(model=MODEL, prompt=f"still there {attempt}", max_tokens=3)
            assert answer.route.node_id != victim and answer.choices[0].finish_reason in ("length", "stop")
        with client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "and streams?"}],
                                            stream=True, max_tokens=4) as survivor:
            assert list(survivor) and survivor.route.node_id != victim

        fleet.wait_for_pool(2, timeout_s=30)
        listed = {n["node_id"] for n in httpx.get(f"{fleet.gateway_url}/v1/nodes").json()["nodes"]}
        assert victim not in listed and len(listed) == 2
