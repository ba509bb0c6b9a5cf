"""`veil audit report routes`: the non-targetability report.

Input: gateway audit files (RouteDecision and NodeAdmitted events). Output in
one directory: `routes.md`, `routes.html` (self-contained, images inlined) and
the PNG plots the Markdown links to. The report rejects the gateway when either
chi-square test (capacity shares, or the gateway's uniform pick among the
client's candidates) has a p-value below alpha.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from audit.events import AuditRecord
from audit.reports.document import Document, Table, WrittenReport
from audit.reports.plots import new_figure, save_png, short_ids
from audit.reports.route_stats import (
    REPEAT_REQUESTS,
    AttackerOutcome,
    ChiSquare,
    RouteObservations,
    SubsetDeviation,
    WindowTest,
    candidate_test,
    capacity_test,
    collect_routes,
    simulated_attacker,
    subset_deviations,
    window_tests,
)

DEFAULT_ALPHA = 0.01
DEFAULT_WINDOWS = 10
SHARES_PNG = "routes_shares.png"
PVALUES_PNG = "routes_pvalues.png"
SUBSETS_PNG = "routes_subsets.png"


@dataclass(frozen=True, slots=True)
class RoutesReport:
    """Everything the non-targetability report states, before rendering."""

    observations: RouteObservations
    alpha: float
    capacity: ChiSquare
    candidates: ChiSquare | None
    subsets: list[SubsetDeviation]
    attacker: list[AttackerOutcome]
    windows: list[WindowTest]

    @property
    def rejected(self) -> bool:
        """True when the routes are not consistent with capacity-weighted uniform routing."""
        tests = [self.capacity] + ([self.candidates] if self.candidates else [])
        return any(test.p_value < self.alpha for test in tests)


def build_routes_report(
    records: Iterable[AuditRecord],
    capacity_overrides: Mapping[str, int] | None = None,
    *,
    alpha: float = DEFAULT_ALPHA,
    windows: int = DEFAULT_WINDOWS,
) -> RoutesReport:
    """Compute the non-targetability statistics from audit records."""
    observations = collect_routes(records, capacity_overrides or {})
    subsets = subset_deviations(observations, max_m=max(1, len(observations.node_ids) // 2))
    return RoutesReport(
        observations=observations,
        alpha=alpha,
        capacity=capacity_test(observations),
        candidates=candidate_test(observations),
        subsets=subsets,
        attacker=simulated_attacker(observations, subsets),
        windows=window_tests(observations, windows),
    )


def write_routes_report(report: RoutesReport, out_dir: Path) -> WrittenReport:
    """Write routes.md, routes.html and the PNG plots into `out_dir` (created if needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    images = (_plot_shares(report, out_dir / SHARES_PNG),
              _plot_pvalues(report, out_dir / PVALUES_PNG),
              _plot_subsets(report, out_dir / SUBSETS_PNG))
    markdown, html = _document(report, images).write(out_dir, "routes")
    return WrittenReport(markdown=markdown, html=html, images=images, passed=not report.rejected)


def _pct(value: float) -> str:
    return f"{100 * value:.3f}%"


def _pp(value: float) -> str:
    return f"{100 * value:+.3f} pp"


def _p(value: float) -> str:
    return f"{value:.3g}"


def _document(report: RoutesReport, images: tuple[Path, ...]) -> Document:
    obs = report.observations
    doc = Document("Veil non-targetability report")
    _verdict(doc, report)
    doc.paragraph(
        f"{sum(obs.outcomes.values())} route decisions from {obs.gateways} gateway(s) over "
        f"{len(obs.node_ids)} nodes; {obs.chosen.size} reached a node. Promise: an attacker holding "
        "nodes T receives a request with probability ΣC(T)/ΣC(S), no more."
    )
    doc.table(Table(("outcome", "decisions"), tuple((name, str(count)) for name, count in sorted(obs.outcomes.items()))))
    if obs.evicted_nodes:
        doc.warning(f"{obs.evicted_nodes} node(s) were evicted during this period; capacity shares assume "
                    "a fixed fleet, the candidate test does not.")
    _shares_section(doc, report, images[0])
    _tests_section(doc, report)
    _subsets_section(doc, report, images[2])
    _attacker_section(doc, report)
    _windows_section(doc, report, images[1])
    _method_section(doc)
    return doc


def _verdict(doc: Document, report: RoutesReport) -> None:
    if report.rejected:
        doc.verdict(f"Routing deviates from capacity-weighted uniform choice (p < {report.alpha}): "
                    "some nodes receive more requests than their capacity entitles them to.", passed=False)
        if report.candidates is not None and report.candidates.p_value >= report.alpha:
            doc.warning("The gateways' picks are uniform among the candidates they were given, so the deviation "
                        "comes from how candidates are drawn: each node must be a candidate with probability "
                        "K·C/ΣC for a uniform pick among K to give it exactly C/ΣC.")
    else:
        doc.verdict(f"Routing is consistent with capacity-weighted uniform choice (no test rejects at "
                    f"alpha = {report.alpha}).", passed=True)


def _shares_section(doc: Document, report: RoutesReport, image: Path) -> None:
    obs = report.observations
    counts, share = obs.observed_counts, obs.capacity_share
    decisions = obs.chosen.size
    sigma = np.sqrt(share * (1 - share) / decisions)
    rows = tuple(
        (node_id, str(int(obs.capacities[i])), _pct(share[i]), str(int(counts[i])),
         _pct(counts[i] / decisions), _pp(counts[i] / decisions - share[i]),
         f"{(counts[i] / decisions - share[i]) / sigma[i]:+.2f}")
        for i, node_id in enumerate(obs.node_ids)
    )
    doc.heading("Observed share per node vs capacity share")
    doc.table(Table(("node", "capacity", "capacity share", "requests", "observed share", "deviation", "z"), rows))
    doc.image(image, "observed vs expected share per node")


def _tests_section(doc: Document, report: RoutesReport) -> None:
    tests = [("capacity shares (all routed decisions)", report.capacity)]
    if report.candidates is not None:
        tests.append(("uniform pick among the client's candidates (first-pick decisions)", report.candidates))
    rows, red = [], set()
    for index, (name, test) in enumerate(tests):
        rejected = test.p_value < report.alpha
        if rejected:
            red.add(index)
        rows.append((name, str(test.decisions), f"{test.statistic:.2f}", str(test.dof), _p(test.p_value),
                     "reject" if rejected else "consistent"))
    doc.heading("Chi-square goodness of fit")
    doc.table(Table(("test", "decisions", "chi²", "dof", "p-value", "result"), tuple(rows), frozenset(red)))


def _subsets_section(doc: Document, report: RoutesReport, image: Path) -> None:
    label = short_ids(report.observations.node_ids)
    rows = tuple(
        (str(s.m), ", ".join(label[n] for n in s.nodes), _pct(s.observed_share), _pct(s.capacity_share),
         _pp(s.deviation), _pp(s.null_q99), _p(s.null_p_value))
        for s in report.subsets
    )
    doc.heading("Largest deviation of any m-node subset")
    doc.paragraph("For each m, the subset T of m nodes whose observed share most exceeds ΣC(T)/ΣC(S) "
                  "(exact: the m largest per-node excesses), against the same statistic in "
                  "simulated honest fleets with these capacities and this many decisions.")
    doc.table(Table(("m", "worst subset", "observed", "ΣC(T)/ΣC(S)", "deviation", "honest 99th pct.",
                     "p-value"), rows))
    doc.image(image, "worst subset deviation vs honest fleets")


def _attacker_section(doc: Document, report: RoutesReport) -> None:
    rows, red = [], set()
    for index, a in enumerate(report.attacker):
        if a.exceeds_noise:
            red.add(index)
        failover = "—" if a.failover_reach is None else _pct(a.failover_reach)
        rows.append((str(a.m), _pct(a.bound), _pct(a.reach), _pp(a.excess), failover,
                     _pct(a.over_requests(a.bound)), _pct(a.over_requests(a.reach))))
    doc.heading("Simulated attacker")
    doc.paragraph(f"An attacker compromises the m nodes with the highest observed share. Columns: the bound "
                  f"ΣC(T)/ΣC(S); how often a request landed on them; among failover routes (a node failing "
                  f"on purpose is the one steering lever a node has); the chance that at least one of "
                  f"{REPEAT_REQUESTS} requests of one user lands on them, by the bound and as observed. "
                  "Red rows exceed what honest routing produces 99% of the time.")
    doc.table(Table(("m", "bound", "reach", "excess", "reach via failover",
                     f"bound, {REPEAT_REQUESTS} req.", f"reach, {REPEAT_REQUESTS} req."),
                    tuple(rows), frozenset(red)))


def _windows_section(doc: Document, report: RoutesReport, image: Path) -> None:
    rows = tuple((str(w.index), str(w.first_ts), str(w.last_ts), str(w.test.decisions), _p(w.test.p_value))
                 for w in report.windows)
    below = sum(w.test.p_value < report.alpha for w in report.windows)
    doc.heading("Over time")
    doc.paragraph(f"The capacity test on {len(report.windows)} consecutive windows of equal size. Under honest "
                  f"routing p-values are uniform, so about {report.alpha:.0%} of windows fall below alpha by "
                  f"chance; here {below} did.")
    doc.table(Table(("window", "first ts", "last ts", "decisions", "p-value"), rows))
    doc.image(image, "p-value per time window")


def _method_section(doc: Document) -> None:
    doc.heading("Method and limits")
    doc.paragraph("Only route events are used: candidates, chosen node and outcome per request, and the "
                  "capacities the gateways admitted nodes with (or given with --capacity). No event holds "
                  "anything about a user. The capacity test covers every decision that sent a request to a node; "
                  "the candidate test covers decisions served by the gateway's first pick and checks that pick "
                  "alone, whatever the clients' candidate draws. Capacities are the nodes' admitted claims: a node "
                  "that overstates its capacity raises its own bound, which the policy must prevent. Simulated "
                  "honest fleets use a fixed seed, so the same files always give the same report.")


def _plot_shares(report: RoutesReport, path: Path) -> Path:
    obs = report.observations
    decisions = obs.chosen.size
    share = obs.capacity_share
    positions = np.arange(len(obs.node_ids))
    figure = new_figure(max(8.0, 0.5 * len(positions)), 4.5)
    axes = figure.add_subplot()
    axes.bar(positions - 0.2, 100 * share, width=0.4, label="capacity share (expected)", color="#8aa")
    axes.bar(positions + 0.2, 100 * obs.observed_counts / decisions, width=0.4, label="observed share",
             color="#36c", yerr=200 * np.sqrt(share * (1 - share) / decisions), capsize=2)
    label = short_ids(obs.node_ids)
    axes.set_xticks(positions, [label[n] for n in obs.node_ids], rotation=60, fontsize=7)
    axes.set_ylabel("share of requests (%)")
    axes.set_title("Observed vs expected share per node (error bars: ±2σ of honest routing)")
    axes.legend()
    return save_png(figure, path)


def _plot_pvalues(report: RoutesReport, path: Path) -> Path:
    figure = new_figure(8.0, 4.0)
    axes = figure.add_subplot()
    p_values = [max(w.test.p_value, 1e-300) for w in report.windows]
    axes.plot([w.index for w in report.windows], p_values, marker="o", color="#36c", label="window p-value")
    axes.axhline(report.alpha, color="#c00", linestyle="--", label=f"alpha = {report.alpha}")
    axes.set_yscale("log")
    axes.set_xlabel("time window (consecutive decisions)")
    axes.set_ylabel("chi-square p-value")
    axes.set_title("Capacity goodness of fit over time")
    axes.legend()
    return save_png(figure, path)


def _plot_subsets(report: RoutesReport, path: Path) -> Path:
    figure = new_figure(8.0, 4.0)
    axes = figure.add_subplot()
    m = [s.m for s in report.subsets]
    axes.plot(m, [100 * s.deviation for s in report.subsets], marker="o", color="#36c", label="observed worst subset")
    axes.plot(m, [100 * s.null_q99 for s in report.subsets], linestyle="--", color="#c00",
              label="honest fleets, 99th percentile")
    axes.set_xlabel("m (nodes compromised)")
    axes.set_ylabel("observed − ΣC(T)/ΣC(S) (pp)")
    axes.set_title("Largest deviation of any m-node subset")
    axes.legend()
    return save_png(figure, path)
