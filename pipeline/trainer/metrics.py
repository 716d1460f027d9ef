"""The trainer's Prometheus metrics (``trainer.metrics_port``): its state, its steps, the
gate's progress and verdicts, and the times it followed an operator. One registry per
instance, so tests build several in one process; documented in docs/components.md
(Operating)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

STATES = ("training", "judging", "paused", "stopped")


class TrainerMetrics:
    def __init__(self, policy: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.state = Gauge(
            "liverl_trainer_state",
            "1 for the state the trainer is in "
            "(training, judging, paused, stopped), 0 for the others",
            ["policy", "state"],
            registry=r,
        )
        self.version = Gauge(
            "liverl_trainer_version",
            "The version whose weights the trainer holds and trains on from (0: the base)",
            ["policy"],
            registry=r,
        )
        self.step = Gauge("liverl_trainer_step", "Optimizer steps so far", ["policy"], registry=r)
        self.samples = Counter(
            "liverl_trainer_samples",
            "Samples trained since the trainer started",
            ["policy"],
            registry=r,
        )
        self.loss = Gauge(
            "liverl_trainer_loss", "The last step's total loss", ["policy"], registry=r
        )
        self.last_step = Gauge(
            "liverl_trainer_last_step_timestamp_seconds",
            "When the last optimizer step ended (Unix time)",
            ["policy"],
            registry=r,
        )
        self.gate_done = Gauge(
            "liverl_trainer_gate_prompts_done",
            "Prompts the running evaluation has answered (0 when none runs)",
            ["policy"],
            registry=r,
        )
        self.gate_total = Gauge(
            "liverl_trainer_gate_prompts_total",
            "Prompts the running evaluation answers in all (0 when none runs)",
            ["policy"],
            registry=r,
        )
        self.gate_eta = Gauge(
            "liverl_trainer_gate_eta_seconds",
            "Seconds the running evaluation still needs, from its rate so far",
            ["policy"],
            registry=r,
        )
        self.verdicts = Counter(
            "liverl_trainer_gate_verdicts",
            "Gate verdicts by status "
            "(promoted, rejected, candidate: no decision; none: too few "
            "held-out prompts)",
            ["policy", "status"],
            registry=r,
        )
        self.follows = Counter(
            "liverl_trainer_follows",
            "Times the trainer followed an "
            "operator's action: switch (trained on from the version that "
            "serves), pause, resume",
            ["policy", "kind"],
            registry=r,
        )
        self.policy = policy

    def set_state(self, state: str) -> None:
        for s in STATES:
            self.state.labels(self.policy, s).set(1.0 if s == state else 0.0)

    def serve(self, host: str, port: int) -> object:
        """Start the HTTP endpoint; returns the server (``shutdown()`` stops it)."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
