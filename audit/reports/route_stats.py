"""Statistics of non-targetability, from gateway route events alone.

For nodes S with capacities C, an attacker holding nodes T should receive a
given request with probability exactly ΣC(T)/ΣC(S). These functions compare
the routes the gateways actually took with that promise: per node (chi-square
goodness of fit), for the worst subset of m nodes, and for an attacker who
compromises the m nodes with the highest observed share.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from audit.errors import AuditReportError
from audit.events import AuditRecord, NodeAdmitted, NodeEvicted, RouteDecision, RouteOutcome

# Chi-square needs about five expected decisions per cell to be trustworthy.
MIN_EXPECTED_PER_NODE = 5.0
# Monte Carlo draws of an honest fleet for the subset-deviation null distribution;
# a fixed seed makes a report reproducible from its input files.
NULL_REPLICATES = 2000
NULL_SEED = 20240501
REPEAT_REQUESTS = 10


@dataclass(frozen=True, slots=True)
class RouteObservations:
    """Route decisions reduced to arrays over a fixed, sorted list of nodes."""

    node_ids: tuple[str, ...]
    capacities: np.ndarray  # per node
    chosen: np.ndarray  # node index of every decision that reached a node, in time order
    chosen_ts: np.ndarray  # its timestamp
    first_pick: np.ndarray  # True where the gateway's first pick served the request (outcome ok)
    failover: np.ndarray  # True where the request was served after a failover
    candidate_weight: np.ndarray  # per node: Σ 1/k over ok decisions whose k candidates include it
    outcomes: Mapping[str, int]
    gateways: int
    evicted_nodes: int

    @property
    def capacity_share(self) -> np.ndarray:
        return self.capacities / self.capacities.sum()

    @property
    def observed_counts(self) -> np.ndarray:
        return np.bincount(self.chosen, minlength=len(self.node_ids))


@dataclass(frozen=True, slots=True)
class ChiSquare:
    """A chi-square goodness-of-fit test of observed counts against expected counts."""

    decisions: int
    statistic: float
    dof: int
    p_value: float


@dataclass(frozen=True, slots=True)
class SubsetDeviation:
    """The m-node subset whose observed share exceeds its capacity share the most."""

    m: int
    nodes: tuple[str, ...]
    observed_share: float
    capacity_share: float
    null_q99: float  # 99th percentile of this deviation under an honest gateway
    null_p_value: float

    @property
    def deviation(self) -> float:
        return self.observed_share - self.capacity_share


@dataclass(frozen=True, slots=True)
class AttackerOutcome:
    """An attacker who compromised the m nodes with the highest observed share."""

    m: int
    nodes: tuple[str, ...]
    bound: float  # ΣC(T)/ΣC(S): what non-targetability promises
    reach: float  # observed probability that a request lands on T
    failover_reach: float | None  # the same among failover routes, None without failovers
    exceeds_noise: bool  # excess above the honest-fleet 99th percentile for m nodes

    @property
    def excess(self) -> float:
        return self.reach - self.bound

    def over_requests(self, share: float, requests: int = REPEAT_REQUESTS) -> float:
        """Probability that at least one of `requests` independent requests lands on T."""
        return 1.0 - (1.0 - share) ** requests


@dataclass(frozen=True, slots=True)
class WindowTest:
    """The capacity chi-square test on one time window of consecutive decisions."""

    index: int
    first_ts: int
    last_ts: int
    test: ChiSquare


def collect_routes(records: Iterable[AuditRecord], capacity_overrides: Mapping[str, int]) -> RouteObservations:
    """Reduce route and admission events to arrays; capacities come from NodeAdmitted
    (the latest per node) unless overridden."""
    capacities: dict[str, int] = {}
    chosen: list[str] = []
    chosen_ts: list[int] = []
    chosen_outcome: list[RouteOutcome] = []
    ok_candidates: list[tuple[str, ...]] = []
    outcomes: Counter[str] = Counter()
    gateways: set[str] = set()
    routed_nodes: set[str] = set()
    evicted: set[str] = set()
    for record in records:
        event = record.event
        if isinstance(event, NodeAdmitted):
            capacities[event.node_id] = event.capacity
        elif isinstance(event, NodeEvicted):
            evicted.add(event.node_id)
        elif isinstance(event, RouteDecision):
            outcomes[event.outcome.value] += 1
            gateways.add(event.gateway_id)
            routed_nodes.update(event.candidates)
            if event.chosen is not None:
                chosen.append(event.chosen)
                chosen_ts.append(record.ts)
                chosen_outcome.append(event.outcome)
                if event.outcome is RouteOutcome.OK:
                    ok_candidates.append(event.candidates)
    capacities.update(capacity_overrides)
    _require_capacities(routed_nodes, capacities)
    if not chosen:
        raise AuditReportError("no route decision reached a node; pass the gateways' audit files")
    node_ids = tuple(sorted(capacities))
    index = {node_id: position for position, node_id in enumerate(node_ids)}
    weight = np.zeros(len(node_ids))
    for candidates in ok_candidates:
        for node_id in candidates:
            weight[index[node_id]] += 1.0 / len(candidates)
    outcome_array = np.array([outcome.value for outcome in chosen_outcome])
    return RouteObservations(
        node_ids=node_ids,
        capacities=np.array([capacities[node_id] for node_id in node_ids], dtype=float),
        chosen=np.array([index[node_id] for node_id in chosen], dtype=np.int64),
        chosen_ts=np.array(chosen_ts, dtype=np.int64),
        first_pick=outcome_array == RouteOutcome.OK.value,
        failover=outcome_array == RouteOutcome.FAILOVER.value,
        candidate_weight=weight,
        outcomes=dict(outcomes),
        gateways=len(gateways),
        evicted_nodes=len(evicted & set(node_ids)),
    )


def _require_capacities(routed_nodes: set[str], capacities: Mapping[str, int]) -> None:
    missing = sorted(routed_nodes - set(capacities))
    if missing:
        shown = ", ".join(missing[:3]) + (" …" if len(missing) > 3 else "")
        raise AuditReportError(
            f"{len(missing)} node(s) appear in route events without a capacity ({shown}); "
            "include the gateways' node_admitted events or pass --capacity NODE=CAP"
        )


def chi_square(observed: np.ndarray, expected: np.ndarray) -> ChiSquare:
    """Goodness of fit of `observed` counts to `expected` counts (same total); cells
    expected to be empty are left out, since nothing can be observed in them."""
    from scipy.stats import chisquare

    keep = expected > 0
    total = int(observed.sum())
    if keep.sum() < 2:
        return ChiSquare(decisions=total, statistic=0.0, dof=0, p_value=1.0)
    statistic, p_value = chisquare(observed[keep], expected[keep] * (total / expected[keep].sum()))
    return ChiSquare(decisions=total, statistic=float(statistic), dof=int(keep.sum() - 1), p_value=float(p_value))


def capacity_test(observations: RouteObservations) -> ChiSquare:
    """Every decision that reached a node against the capacity shares."""
    observed = observations.observed_counts
    return chi_square(observed, observations.capacity_share * observed.sum())


def candidate_test(observations: RouteObservations) -> ChiSquare | None:
    """The gateway's own choice, isolated from how clients drew their candidates:
    on decisions served by the first pick, each of the k candidates should be
    chosen with probability 1/k. None when no decision was served by its first pick."""
    chosen = observations.chosen[observations.first_pick]
    if chosen.size == 0:
        return None
    observed = np.bincount(chosen, minlength=len(observations.node_ids))
    return chi_square(observed, observations.candidate_weight)


def subset_deviations(observations: RouteObservations, max_m: int) -> list[SubsetDeviation]:
    """For m = 1..max_m, the largest observed-minus-capacity share over all m-node subsets.

    Σ_{i∈T}(observed_i − expected_i) is a sum of independent per-node terms, so
    for a fixed size m the maximum is reached by the m largest terms (swapping a
    member for an outsider with a larger term only increases the sum): sorting
    gives the exact worst subset without enumerating C(n, m) subsets.
    """
    share = observations.capacity_share
    decisions = observations.chosen.size
    difference = observations.observed_counts / decisions - share
    order = np.argsort(-difference, kind="stable")
    worst = np.cumsum(difference[order])[:max_m]
    null = _honest_null(share, decisions, max_m)
    results = []
    for m in range(1, max_m + 1):
        members = order[:m]
        exceed = int((null[:, m - 1] >= worst[m - 1] - 1e-12).sum())
        results.append(SubsetDeviation(
            m=m,
            nodes=tuple(observations.node_ids[i] for i in members),
            observed_share=float(observations.observed_counts[members].sum() / decisions),
            capacity_share=float(share[members].sum()),
            null_q99=float(np.quantile(null[:, m - 1], 0.99)),
            null_p_value=(1 + exceed) / (1 + NULL_REPLICATES),
        ))
    return results


def _honest_null(share: np.ndarray, decisions: int, max_m: int) -> np.ndarray:
    """Worst m-subset deviations of honest fleets with the same capacities and volume:
    one row per replicate, one column per m."""
    rng = np.random.default_rng(NULL_SEED)
    draws = rng.multinomial(decisions, share, size=NULL_REPLICATES) / decisions - share
    draws = -np.sort(-draws, axis=1)
    return np.cumsum(draws, axis=1)[:, :max_m]


def simulated_attacker(observations: RouteObservations, subsets: list[SubsetDeviation]) -> list[AttackerOutcome]:
    """The attacker compromises the m highest-share nodes; how often do requests land there?"""
    counts = observations.observed_counts
    decisions = observations.chosen.size
    order = np.argsort(-counts, kind="stable")
    failover_chosen = observations.chosen[observations.failover]
    results = []
    for subset in subsets:
        members = order[:subset.m]
        reach = float(counts[members].sum() / decisions)
        bound = float(observations.capacity_share[members].sum())
        failover_reach = (float(np.isin(failover_chosen, members).mean())
                          if failover_chosen.size else None)
        results.append(AttackerOutcome(
            m=subset.m,
            nodes=tuple(observations.node_ids[i] for i in members),
            bound=bound,
            reach=reach,
            failover_reach=failover_reach,
            exceeds_noise=reach - bound > subset.null_q99,
        ))
    return results


def window_tests(observations: RouteObservations, requested_windows: int) -> list[WindowTest]:
    """The capacity test on consecutive windows of decisions (equal counts, time order),
    as many as keep at least five expected decisions per node, up to `requested_windows`."""
    decisions = observations.chosen.size
    smallest_share = float(observations.capacity_share.min())
    affordable = math.floor(decisions * smallest_share / MIN_EXPECTED_PER_NODE)
    windows = max(1, min(requested_windows, affordable))
    share = observations.capacity_share
    results = []
    for index, positions in enumerate(np.array_split(np.arange(decisions), windows)):
        observed = np.bincount(observations.chosen[positions], minlength=len(observations.node_ids))
        results.append(WindowTest(
            index=index,
            first_ts=int(observations.chosen_ts[positions[0]]),
            last_ts=int(observations.chosen_ts[positions[-1]]),
            test=chi_square(observed, share * positions.size),
        ))
    return results
