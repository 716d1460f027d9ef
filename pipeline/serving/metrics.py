"""Prometheus metrics, one registry per app (tests build several apps in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "liverl_gateway_requests", "Chat requests by HTTP status", ["status"], registry=r
        )
        self.latency = Histogram(
            "liverl_gateway_request_seconds",
            "Time to full answer",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.tokens = Counter("liverl_gateway_tokens", "Tokens by kind", ["kind"], registry=r)
        self.recorded = Counter(
            "liverl_gateway_interactions_recorded",
            "Interactions handed to the recorder",
            registry=r,
        )
        self.lost = Counter(
            "liverl_gateway_events_lost",
            "Events that could be neither spooled nor produced",
            registry=r,
        )
        self.dead_lettered = Counter(
            "liverl_gateway_events_dead_lettered",
            "Events replaced by a dead letter (unencodable, too large, refused)",
            registry=r,
        )
        self.aborted = Counter(
            "liverl_gateway_turns_aborted",
            "Turns whose client went away before the answer; recorded with train=false",
            registry=r,
        )
        self.quarantined = Counter(
            "liverl_gateway_spool_quarantined",
            "Damaged or unreadable spooled frames moved to quarantine/ and dead-lettered",
            registry=r,
        )
        self.feedback_limited = Counter(
            "liverl_gateway_feedback_rate_limited",
            "POST /v1/feedback refused with 429 by serve.feedback_rate_limit_per_min",
            registry=r,
        )
        self.posts_not_recorded = Counter(
            "liverl_gateway_posts_not_recorded",
            "Posted next states not recorded: forbidden (another user's session), "
            "per_turn_cap (serve.next_states_per_turn), repeat (equal to one recorded)",
            ["reason"],
            registry=r,
        )
        self.weight_version = Gauge(
            "liverl_gateway_weight_version", "Weight version now serving (0: the base)", registry=r
        )
        self.reloads = Counter(
            "liverl_gateway_reloads", "Weight reloads by outcome", ["ok"], registry=r
        )
        self.actions = Counter(
            "liverl_gateway_operator_actions",
            "Operator actions (liverl versions promote, pin, unpin, rollback) this replica "
            "folded from the weights log, by kind; the whole log is folded again at start",
            ["kind"],
            registry=r,
        )
        self.backlog = Gauge(
            "liverl_gateway_record_backlog", "Events not yet confirmed by Kafka", registry=r
        )
        self.spool_bytes = Gauge(
            "liverl_gateway_spool_bytes", "Size of the local spool on disk", registry=r
        )

    def bind(
        self,
        version: Callable[[], float],
        backlog: Callable[[], float] | None,
        spool_bytes: Callable[[], float] | None,
    ) -> None:
        self.weight_version.set_function(version)
        self.backlog.set_function(backlog or (lambda: 0))
        self.spool_bytes.set_function(spool_bytes or (lambda: 0))
