"""The non-targetability report, on simulated gateways: honest ones pass, a 2% bias is caught."""

from __future__ import annotations

import base64
import hashlib
import itertools
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from audit import AuditRecord, AuditReportError, JsonLinesSink, NodeAdmitted, RouteDecision
from audit.reports.route_stats import collect_routes, subset_deviations
from audit.reports.routes import build_routes_report, write_routes_report
from tests.test_audit_cli import veil_audit

NODES = 16
CANDIDATES = 3
DECISIONS = 100_000
GATEWAY = "9a" * 8
NODE_IDS = [hashlib.sha256(f"node {i}".encode()).hexdigest()[:32] for i in range(NODES)]
# Unequal capacities, from 2 to 24 concurrent sequences.
CAPACITIES = np.array([2, 3, 4, 5, 6, 8, 8, 10, 12, 12, 14, 16, 18, 20, 22, 24])
FAVOURED = 5  # the node a biased gateway steers toward: a small one (4.9% of capacity)
LARGE = 14  # a large node (13.4% of capacity)
BIAS = 0.02  # absolute share added to the favoured node


def simulate_routes(seed: int, bias: float = 0.0, decisions: int = DECISIONS,
                    favoured: int = FAVOURED) -> tuple[np.ndarray, np.ndarray]:
    """Candidates drawn by clients and the node the gateway chose, per decision.

    Clients draw K candidates with inclusion probability K·C/ΣC (systematic
    sampling), so an honest gateway picking uniformly among them routes with
    probability exactly C/ΣC. A biased gateway, whenever the favoured node is a
    candidate, picks it with the extra probability that adds `bias` to its share.
    """
    rng = np.random.default_rng(seed)
    inclusion = CANDIDATES * CAPACITIES / CAPACITIES.sum()
    edges = np.concatenate([[0.0], np.cumsum(inclusion)])
    points = rng.random(decisions)[:, None] + np.arange(CANDIDATES)
    candidates = np.searchsorted(edges, points, side="right") - 1
    chosen = candidates[np.arange(decisions), rng.integers(0, CANDIDATES, decisions)]
    if bias:
        override = bias / (inclusion[favoured] * (1 - 1 / CANDIDATES))
        steer = (candidates == favoured).any(axis=1) & (rng.random(decisions) < override)
        chosen = np.where(steer, favoured, chosen)
    return candidates, chosen


def route_events(candidates: np.ndarray, chosen: np.ndarray) -> list:
    admitted = [NodeAdmitted(GATEWAY, NODE_IDS[i], int(CAPACITIES[i])) for i in range(NODES)]
    routes = [RouteDecision(GATEWAY, tuple(NODE_IDS[c] for c in row), NODE_IDS[pick], "ok", "10-49ms")
              for row, pick in zip(candidates.tolist(), chosen.tolist())]
    return admitted + routes


def write_audit_file(path, events) -> None:
    # 100 decisions per second of simulated time, so the report has many time windows.
    ticks = itertools.count()
    with JsonLinesSink(path, queue_size=len(events) + 1, clock=lambda: 1_700_000_000 + next(ticks) / 100) as sink:
        for event in events:
            sink.emit(event)


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 300 and height >= 200 and len(data) > 5_000


def assert_report_files(out_dir) -> str:
    for name in ("routes_shares.png", "routes_pvalues.png", "routes_subsets.png"):
        assert_png(out_dir / name)
        assert f"({name})" in (out_dir / "routes.md").read_text()
    html = (out_dir / "routes.html").read_text()
    inlined = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(inlined) == 3
    assert base64.b64decode(inlined[0]) == (out_dir / "routes_shares.png").read_bytes()
    return (out_dir / "routes.md").read_text()


@dataclass(frozen=True)
class GatewayRun:
    """A simulated gateway's events, and `veil audit report routes` run on its audit file."""

    events: list
    exit_code: int
    out_dir: Path


def run_gateway(tmp_path_factory, name: str, bias: float) -> GatewayRun:
    """Done-when scale: 100,000 decisions over 16 unequal nodes, through a JSON lines file and the CLI."""
    events = route_events(*simulate_routes(seed=1, bias=bias))
    directory = tmp_path_factory.mktemp(name)
    write_audit_file(directory / "gateway.jsonl", events)
    out_dir = directory / "report"
    exit_code = veil_audit(["report", "routes", str(directory / "gateway.jsonl"), "--out", str(out_dir)])
    return GatewayRun(events, exit_code, out_dir)


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> GatewayRun:
    return run_gateway(tmp_path_factory, "honest", bias=0.0)


@pytest.fixture(scope="module")
def biased(tmp_path_factory) -> GatewayRun:
    return run_gateway(tmp_path_factory, "biased", bias=BIAS)


def test_honest_gateway_is_not_rejected(honest):
    assert honest.exit_code == 0
    markdown = assert_report_files(honest.out_dir)
    assert "✓ Routing is consistent" in markdown
    assert "RED LINE" not in markdown
    table = re.search(r"\| capacity shares \(all routed decisions\) \| 100000 \| [\d.]+ \| 15 \| ([\d.e-]+) \|", markdown)
    assert table and float(table.group(1)) > 0.01


def test_gateway_biased_two_percent_toward_one_node_is_rejected(biased):
    assert biased.exit_code == 1
    markdown = assert_report_files(biased.out_dir)
    assert "✗ RED LINE: Routing deviates" in markdown
    assert 'class="red"' in (biased.out_dir / "routes.html").read_text()


def test_statistics_of_honest_and_biased_gateways(honest, biased):
    honest_report = build_routes_report([AuditRecord(0, event) for event in honest.events])
    biased_report = build_routes_report([AuditRecord(0, event) for event in biased.events])
    assert honest_report.capacity.p_value > 0.01 and honest_report.candidates.p_value > 0.01
    assert not honest_report.rejected
    assert biased_report.capacity.p_value < 1e-6 and biased_report.candidates.p_value < 1e-6
    assert biased_report.rejected
    # The worst single node is the favoured one, about two points above its capacity share.
    worst = biased_report.subsets[0]
    assert worst.nodes == (NODE_IDS[FAVOURED],)
    assert 0.015 < worst.deviation < 0.025 and worst.null_p_value < 0.01
    assert all(subset.deviation < subset.null_q99 * 1.5 for subset in honest_report.subsets)
    assert not any(outcome.exceeds_noise for outcome in honest_report.attacker)
    assert len(honest_report.subsets) == NODES // 2


def test_attacker_on_the_highest_share_nodes_gains_from_a_bias_toward_a_large_node():
    records = [AuditRecord(0, event)
               for event in route_events(*simulate_routes(seed=5, bias=BIAS, decisions=30_000, favoured=LARGE))]
    report = build_routes_report(records)
    top = report.attacker[0]
    assert top.nodes == (NODE_IDS[LARGE],)
    assert top.excess == pytest.approx(BIAS, abs=0.008)
    assert top.exceeds_noise
    assert top.over_requests(top.reach) > top.over_requests(top.bound)


def test_worst_subset_matches_brute_force():
    """Sorting per-node excesses gives the same worst m-subset as enumerating every subset."""
    capacities = {NODE_IDS[i]: c for i, c in enumerate([1, 2, 3, 5, 8, 13])}
    rng = np.random.default_rng(9)
    picks = rng.choice(6, size=3_000, p=np.array([1, 3, 3, 5, 7, 13]) / 32)
    records = [AuditRecord(0, RouteDecision(GATEWAY, (NODE_IDS[p],), NODE_IDS[p], "ok", "0-9ms")) for p in picks]
    observations = collect_routes(records, capacities)
    share = observations.capacity_share
    observed = observations.observed_counts / observations.chosen.size
    for result in subset_deviations(observations, max_m=5):
        brute = max(sum(observed[i] - share[i] for i in subset)
                    for subset in itertools.combinations(range(6), result.m))
        assert result.deviation == pytest.approx(brute, abs=1e-12)


def test_missing_capacities_are_an_error_with_advice():
    records = [AuditRecord(0, RouteDecision(GATEWAY, (NODE_IDS[0], NODE_IDS[1]), NODE_IDS[0], "ok", "0-9ms"))]
    with pytest.raises(AuditReportError, match="--capacity"):
        build_routes_report(records)
    report = build_routes_report(records, {NODE_IDS[0]: 1, NODE_IDS[1]: 1})
    assert report.capacity.decisions == 1


def test_decisions_that_reached_no_node_are_counted_but_not_tested(tmp_path):
    events = route_events(*simulate_routes(seed=4, decisions=2_000))
    events.append(RouteDecision(GATEWAY, (NODE_IDS[0],), None, "no_candidate", "0-9ms"))
    report = build_routes_report([AuditRecord(0, event) for event in events])
    assert report.observations.outcomes == {"ok": 2_000, "no_candidate": 1}
    assert report.capacity.decisions == 2_000
    # Few decisions: windows shrink so every node still expects five requests per window.
    smallest_share = CAPACITIES.min() / CAPACITIES.sum()
    assert all(w.test.decisions * smallest_share >= 5 for w in report.windows)
    written = write_routes_report(report, tmp_path)
    assert written.passed == (not report.rejected)
    for image in written.images:
        assert_png(image)


def test_skewed_candidate_draws_are_told_apart_from_a_biased_gateway(tmp_path):
    """Clients drawing candidates one weighted draw at a time without replacement over-include small
    nodes; an honest gateway's uniform pick then misses C/ΣC, and the report says where the skew is."""
    rng = np.random.default_rng(6)
    share = CAPACITIES / CAPACITIES.sum()
    candidates = np.array([rng.choice(NODES, CANDIDATES, replace=False, p=share) for _ in range(30_000)])
    chosen = candidates[np.arange(len(candidates)), rng.integers(0, CANDIDATES, len(candidates))]
    report = build_routes_report([AuditRecord(0, event) for event in route_events(candidates, chosen)])
    assert report.rejected and report.capacity.p_value < 0.01
    assert report.candidates.p_value > 0.01
    markdown = write_routes_report(report, tmp_path).markdown.read_text()
    assert "comes from how candidates are drawn" in markdown
