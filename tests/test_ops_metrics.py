"""Prometheus metrics carry nothing personal: a fixed set of names and labels, aggregates of typed audit fields.

The canary fleet is real processes on loopback (an issuer, a relay, a gateway and two nodes with their
metrics ports on); every request carries a canary and a token, and every scrape of every process is
searched for the canary, node ids, addresses, the account and the tokens' key id.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from audit.buckets import LATENCY_BUCKETS, TOKEN_BUCKETS
from audit.events import (
    BlocksZeroed,
    EvictionReason,
    NodeAdmitted,
    NodeEvicted,
    ProofFreshness,
    ProofRefreshOutcome,
    ProofsRefreshed,
    RequestFinished,
    RequestStatus,
    RouteDecision,
    RouteOutcome,
    TokenDecisions,
    TokenRefusal,
)
from audit.metrics import METRICS, Metrics, MetricsSink
from audit.sink import MemorySink
from client.sdk import Client
from client.tokens import TokenWallet
from engine.tiny import write_tiny_model
from tests.conftest import HANG_S, REPO_ROOT
from tests.fleet_support import running_fleet
from veil.fleet import Fleet, FleetProcess, FleetSettings

CANARY = "CANARY-41d7-metrics-OCELOT"
NODE_ID = "ab" * 32
GATEWAY_ID = "cd" * 32


def families(exposition: bytes | str) -> dict[str, set[tuple[str, ...]]]:
    """Each metric family of an exposition and the label-name sets its samples carry."""
    text = exposition.decode() if isinstance(exposition, bytes) else exposition
    found: dict[str, set[tuple[str, ...]]] = {}
    for family in text_string_to_metric_families(text):
        found.setdefault(family.name, set()).update(tuple(sorted(s.labels)) for s in family.samples)
    return found


def assert_only_listed(exposition: bytes | str) -> None:
    for name, label_sets in families(exposition).items():
        assert name in METRICS, f"{name} is not in the fixed set"
        assert label_sets <= {tuple(sorted(METRICS[name].labels))}, name


def sample(exposition: bytes | str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    text = exposition.decode() if isinstance(exposition, bytes) else exposition
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# ----- the fixed set ------------------------------------------------------------------------------


def test_the_metric_names_and_labels_are_the_fixed_set() -> None:
    assert {name: (spec.kind, spec.labels) for name, spec in METRICS.items()} == {
        "veil_node_requests": ("counter", ("status", "latency_bucket")),
        "veil_node_prompt_tokens": ("counter", ("bucket",)),
        "veil_node_output_tokens": ("counter", ("bucket",)),
        "veil_node_blocks_zeroed": ("counter", ()),
        "veil_node_residue_blocks": ("counter", ()),
        "veil_node_evidence_refreshes": ("counter", ("outcome",)),
        "veil_node_stops": ("counter", ("reason",)),
        "veil_node_proof_refreshes": ("counter", ("outcome", "proofs")),
        "veil_node_in_flight": ("gauge", ()),
        "veil_node_capacity": ("gauge", ()),
        "veil_gateway_routes": ("counter", ("outcome", "latency_bucket")),
        "veil_gateway_admissions": ("counter", ()),
        "veil_gateway_evictions": ("counter", ("reason",)),
        "veil_gateway_token_decisions": ("counter", ("decision",)),
        "veil_gateway_nodes": ("gauge", ()),
        "veil_gateway_in_flight": ("gauge", ()),
        "veil_relay_requests": ("counter", ("route", "status_class")),
        "veil_relay_in_flight": ("gauge", ()),
        "veil_issuer_token_requests": ("counter", ("outcome",)),
        "veil_audit_events_dropped": ("gauge", ()),
    }


def test_security_md_lists_every_metric_with_its_labels() -> None:
    text = (REPO_ROOT / "SECURITY.md").read_text(encoding="utf-8")
    listed = dict(re.findall(r"^\| `(veil_\w+)` \| [a-z]+ \|([^|]*)\|", text, re.MULTILINE))
    assert set(listed) == set(METRICS)
    for name, labels in listed.items():
        assert tuple(re.findall(r"`(\w+)`", labels)) == METRICS[name].labels, name


def test_an_unlisted_metric_cannot_be_made() -> None:
    with pytest.raises(KeyError):
        Metrics().counter("veil_node_prompts_by_user")
    with pytest.raises(TypeError):
        Metrics().counter("veil_node_in_flight")  # listed as a gauge


def test_every_event_is_counted_by_its_enum_and_bucket_fields_only() -> None:
    metrics = Metrics()
    sink = MetricsSink(MemorySink(), metrics)
    sink.emit(RequestFinished(NODE_ID, RequestStatus.OK, TOKEN_BUCKETS[1], TOKEN_BUCKETS[2], LATENCY_BUCKETS[3], None))
    sink.emit(RequestFinished(NODE_ID, RequestStatus.ABORTED, TOKEN_BUCKETS[1], "0", LATENCY_BUCKETS[0], None))
    sink.emit(BlocksZeroed(NODE_ID, 7, 12, 0))
    sink.emit(RouteDecision(GATEWAY_ID, (NODE_ID,), NODE_ID, RouteOutcome.OK, LATENCY_BUCKETS[2]))
    sink.emit(NodeAdmitted(GATEWAY_ID, NODE_ID, 4))
    sink.emit(NodeEvicted(GATEWAY_ID, NODE_ID, EvictionReason.DRAINED))
    sink.emit(TokenDecisions(GATEWAY_ID, "ee" * 32, 60, 3, {reason: (2 if reason is TokenRefusal.SPENT else 0)
                                                            for reason in TokenRefusal}))
    sink.emit(ProofsRefreshed(NODE_ID, ProofRefreshOutcome.LOG_UNREACHABLE, ProofFreshness.AGING))
    text = metrics.exposition()
    assert_only_listed(text)
    assert sample(text, "veil_node_proof_refreshes_total", outcome="log_unreachable", proofs="aging") == 1
    assert sample(text, "veil_node_requests_total", status="ok", latency_bucket=LATENCY_BUCKETS[3]) == 1
    assert sample(text, "veil_node_prompt_tokens_total", bucket=TOKEN_BUCKETS[1]) == 2
    assert sample(text, "veil_node_output_tokens_total", bucket="0") == 1
    assert sample(text, "veil_node_blocks_zeroed_total") == 12 and sample(text, "veil_node_residue_blocks_total") == 0
    assert sample(text, "veil_gateway_routes_total", outcome="ok") == 1
    assert sample(text, "veil_gateway_admissions_total") == 1
    assert sample(text, "veil_gateway_evictions_total", reason="drained") == 1
    assert sample(text, "veil_gateway_token_decisions_total", decision="accepted") == 3
    assert sample(text, "veil_gateway_token_decisions_total", decision="spent") == 2
    for identifier in (NODE_ID, GATEWAY_ID, "ee" * 32, NODE_ID[:12]):
        assert identifier.encode() not in text
    assert b"_created" not in text  # no series dates the first request of a kind


# ----- the canary fleet ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("ops-metrics")
    settings = FleetSettings(nodes=2, model_dir=write_tiny_model(root / "tiny-model"), workdir=root / "fleet",
                             torch_threads=1, tokens=True, relay=True,
                             extra_node_args=("--metrics-listen", "127.0.0.1:0"),
                             extra_relay_args=("--metrics-listen", "127.0.0.1:0"))
    with running_fleet(settings) as running:
        yield running


class RecordingWallet(TokenWallet):
    """A real wallet that remembers the Authorization values (the tokens) it handed out."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.handed_out: list[str] = []

    def authorization(self) -> str:
        value = super().authorization()
        self.handed_out.append(value)
        return value


def metrics_url(process: FleetProcess) -> str:
    """Where a process's --metrics-listen serves, as it logged it."""
    deadline = time.monotonic() + HANG_S
    while (found := re.search(r"metrics on (\S+)", process.stderr_path.read_text())) is None:
        assert time.monotonic() < deadline, f"{process.name} did not say where its metrics are"
        time.sleep(0.1)
    return f"http://{found.group(1)}/metrics"


@pytest.mark.slow
def test_no_scrape_of_a_canary_fleet_holds_a_canary_an_id_an_address_or_a_token(fleet: Fleet) -> None:
    wallet = fleet.token_wallet(kind=RecordingWallet)
    with Client(fleet.client_url, policy=fleet.policy, tokens=wallet) as client:
        for index in range(4):
            answer = client.chat.completions.create(
                model="tiny-model", messages=[{"role": "user", "content": f"{CANARY} {index}"}], max_tokens=4)
            assert answer.choices
        with client.chat.completions.create(model="tiny-model", stream=True, max_tokens=4,
                                            messages=[{"role": "user", "content": CANARY}]) as stream:
            assert list(stream)
    directory = httpx.get(f"{fleet.gateway_url}/v1/nodes", timeout=10).json()
    node_ids = [entry["node_id"] for entry in directory["nodes"]]
    assert len(node_ids) == 2

    fleet.wait_for_pool(2)
    time.sleep(1.2)  # the nodes' audit tallies (and so their counters) cover at least a second
    scrapes = {name: httpx.get(url, timeout=10).text for name, url in (
        ("gateway", f"{fleet.gateway_url}/metrics"), ("relay", metrics_url(fleet.relay)),
        ("issuer", f"{fleet.issuer_url}/metrics"),
        *((f"node-{i}", metrics_url(node)) for i, node in enumerate(fleet.nodes)))}
    assert httpx.get(f"{fleet.relay_url}/metrics", timeout=10).status_code == 404  # not on the public port

    forbidden = [CANARY, "127.0.0", fleet.account.name, *node_ids, *(node_id[:12] for node_id in node_ids)]
    forbidden += list(fleet.issuer_key_ids)
    tokens = [value.split("token=", 1)[1].strip('"') for value in wallet.handed_out]
    assert len(tokens) == 5
    forbidden += [token[:24] for token in tokens]  # any run of a token's own bytes
    for name, text in scrapes.items():
        assert_only_listed(text)
        for needle in forbidden:
            assert needle not in text, f"{name}'s metrics hold {needle[:8]}…"

    served = sum(sample(scrapes[f"node-{i}"], "veil_node_requests_total", status="ok") for i in range(2))
    assert served == 5
    assert sum(sample(scrapes[f"node-{i}"], "veil_node_capacity") for i in range(2)) == 2 * 8
    assert sample(scrapes["gateway"], "veil_gateway_routes_total", outcome="ok") == 5
    assert sample(scrapes["gateway"], "veil_gateway_nodes") == 2
    assert sample(scrapes["relay"], "veil_relay_requests_total", route="infer", status_class="2xx") == 5
    assert sample(scrapes["issuer"], "veil_issuer_token_requests_total", outcome="issued") >= 1
