"""Prometheus metrics of the canary decider and the regression watch (served by
``liverl versions canary --metrics-port``; documented in docs/components.md)."""

from __future__ import annotations

from typing import Any


class DecisionMetrics:
    """One set per process (the default registry), or per ``registry`` (tests)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        r = REGISTRY if registry is None else registry
        self.canary_version = Gauge(
            "liverl_canary_version", "The canary version (0: no canary)", ["policy"], registry=r
        )
        self.canary_share = Gauge(
            "liverl_canary_share",
            "Share of sessions routed to the canary (0: no canary)",
            ["policy"],
            registry=r,
        )
        self.sessions = Gauge(
            "liverl_canary_sessions",
            "Sessions with an outcome per arm of the running "
            "canary (stable: since the canary became servable)",
            ["policy", "arm"],
            registry=r,
        )
        self.outcome_rate = Gauge(
            "liverl_canary_outcome_rate",
            "Passed share of those sessions per arm",
            ["policy", "arm"],
            registry=r,
        )
        self.p_worse = Gauge(
            "liverl_canary_probability_worse",
            "Posterior P(canary < stable - margin)",
            ["policy"],
            registry=r,
        )
        self.decisions = Counter(
            "liverl_canary_decisions",
            "Canary evaluations by outcome: rollout and withdraw "
            "once per canary, wait at each evaluation with new sessions",
            ["policy", "kind"],
            registry=r,
        )
        self.watch_rate = Gauge(
            "liverl_watch_outcome_rate",
            "Passed share over the watch window: the serving version and its parent",
            ["policy", "side"],
            registry=r,
        )
        self.watch_p_drop = Gauge(
            "liverl_watch_probability_drop",
            "Posterior P(serving < parent - margin) over the watch window",
            ["policy"],
            registry=r,
        )
        self.watch_withdrawals = Counter(
            "liverl_watch_withdrawals",
            "Serving versions the watch withdrew",
            ["policy"],
            registry=r,
        )
        self.watch_alerts = Counter(
            "liverl_watch_alerts",
            "Drops the watch found with watch_action = alert (no event)",
            ["policy"],
            registry=r,
        )


_DEFAULT: DecisionMetrics | None = None


def default() -> DecisionMetrics:
    """The process's metrics on the default registry (created once: a second runner in
    the same process shares them)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = DecisionMetrics()
    return _DEFAULT
