"""The optimizations ARCHITECTURE.md forbids, and the requirement each one breaks.

Two kinds of entries: *knobs* are policy keys Veil defines, whose only allowed
values keep the guarantee (`engine.prefix_sharing = "request"`); *aliases* are
switches other serving stacks use for the same optimization
(`enable_prefix_caching`), refused by name so that a configuration copied from
elsewhere fails loudly instead of as an anonymous unknown key.
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.errors import ForbiddenOptimizationError

STATELESS = "stateless computation"
NON_TARGETABILITY = "non-targetability"
NO_PRIVILEGED_ACCESS = "no privileged runtime access"


@dataclass(frozen=True, slots=True)
class Knob:
    """A policy key whose values are limited to those that keep a requirement."""

    section: str
    key: str
    allowed: tuple[str, ...]
    default: str
    requirement: str
    what: str


@dataclass(frozen=True, slots=True)
class Alias:
    """A foreign configuration switch for a forbidden optimization."""

    section: str
    key: str
    requirement: str
    what: str


KNOBS: tuple[Knob, ...] = (
    Knob("engine", "prefix_sharing", ("request", "off"), "request", STATELESS,
         "prefix caching across requests keeps other users' prompt K/V and leaks prompts "
         "through time to first token; only request-scoped sharing exists"),
    Knob("engine", "kv_offload", ("none",), "none", STATELESS,
         "KV offload to host memory or disk puts K/V on slower or persistent media"),
    Knob("engine", "kv_replication", ("none",), "none", STATELESS,
         "KV duplication across nodes leaves copies of a user's state on other nodes"),
    Knob("engine", "kv_migration", ("none",), "none", NON_TARGETABILITY,
         "KV pulling or request migration moves a user's state to a chosen node"),
    Knob("engine", "scheduling", ("fcfs",), "fcfs", NON_TARGETABILITY,
         "priority by user or predicted length treats chosen users differently; scheduling is FCFS"),
    # What a node may run, by name, so the measured policy says it: "ngram" drafts from each request's
    # own tokens, "draft-model" from a second model, measured with the model; neither keeps anything past
    # the request.
    Knob("engine", "speculation", ("none", "ngram", "draft-model"), "none", STATELESS,
         "speculation from a database of past text serves past users' tokens"),
    Knob("routing", "strategy", ("uniform-random",), "uniform-random", NON_TARGETABILITY,
         "cache-aware, sticky or role-flipping routing gives steering power over users"),
    Knob("audit", "profiling", ("aggregate-counters",), "aggregate-counters", NO_PRIVILEGED_ACCESS,
         "fleet-wide profiling keeps traces of requests; only aggregate audit counters leave a node"),
)

ALIASES: tuple[Alias, ...] = (
    Alias("engine", "enable_prefix_caching", STATELESS, "cross-request prefix caching"),
    Alias("engine", "prefix_caching", STATELESS, "cross-request prefix caching"),
    Alias("engine", "prefix_cache", STATELESS, "cross-request prefix caching"),
    Alias("engine", "cpu_offload_gb", STATELESS, "KV offload to host memory"),
    Alias("engine", "swap_space", STATELESS, "KV offload to host memory"),
    Alias("engine", "kv_offload_dir", STATELESS, "KV offload to disk"),
    Alias("engine", "kv_duplication", STATELESS, "KV duplication across nodes"),
    Alias("engine", "kv_transfer_config", STATELESS, "KV duplication or transfer across nodes"),
    Alias("engine", "request_migration", NON_TARGETABILITY, "request migration across nodes"),
    Alias("engine", "priority_by_user", NON_TARGETABILITY, "priority by user"),
    Alias("engine", "speculation_database", STATELESS, "speculation from a database of past text"),
    Alias("routing", "sticky_sessions", NON_TARGETABILITY, "sticky routing"),
    Alias("routing", "session_affinity", NON_TARGETABILITY, "sticky routing"),
    Alias("routing", "cache_aware", NON_TARGETABILITY, "cache-aware routing"),
    Alias("routing", "prefill_decode_split", NON_TARGETABILITY, "prefill/decode role flips"),
    Alias("audit", "fleet_profiling", NO_PRIVILEGED_ACCESS, "fleet-wide profiling"),
    Alias("audit", "request_traces", NO_PRIVILEGED_ACCESS, "fleet-wide profiling"),
)


def knobs_of(section: str) -> dict[str, Knob]:
    """The knobs that live in one policy section, by key."""
    return {knob.key: knob for knob in KNOBS if knob.section == section}


def refuse_alias(section: str, key: str) -> None:
    """Raise ForbiddenOptimizationError when `section.key` is a known alias of a forbidden optimization."""
    for alias in ALIASES:
        if alias.section == section and alias.key == key:
            raise ForbiddenOptimizationError(
                f"{section}.{key} enables {alias.what}, which breaks {alias.requirement}; "
                f"remove it (Veil never offers this optimization)",
                requirement=alias.requirement,
            )


def check_knob(knob: Knob, value: object) -> str:
    """Return the knob's value when it keeps the requirement; otherwise refuse it."""
    if not isinstance(value, str):
        raise ForbiddenOptimizationError(
            f"{knob.section}.{knob.key} must be one of {list(knob.allowed)}: {knob.what}, "
            f"which breaks {knob.requirement}",
            requirement=knob.requirement,
        )
    if value not in knob.allowed:
        raise ForbiddenOptimizationError(
            f"{knob.section}.{knob.key} = {value!r} is forbidden: {knob.what}, which breaks "
            f"{knob.requirement}; allowed values are {list(knob.allowed)}",
            requirement=knob.requirement,
        )
    return value
