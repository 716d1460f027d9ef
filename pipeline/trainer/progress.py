"""What the trainer is doing, made visible three ways from one place: a log line per step and
per verdict (the gate's "prompt i of n, ETA" at most every ``progress_every_s``), a
``trainer_status`` event (``liverl status`` reads the newest per policy; sent at each change
of state and at most every ``progress_every_s`` between), and Prometheus metrics.

A new user of ``liverl up`` saw 19 minutes of "trainer ready" alone in trainer.log while the
trainer trained and judged: every phase that can last now says so while it lasts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from pipeline import __version__
from pipeline.events import Producer, TrainerStatus, new_event_id, now_ms
from pipeline.events.types import TrainerState
from pipeline.trainer.gate import verdict_line
from pipeline.trainer.metrics import TrainerMetrics

log = logging.getLogger(__name__)
PRODUCER = Producer(component="trainer", version=__version__)


def eta_s(elapsed_s: float, done: int, total: int) -> float | None:
    """Seconds left at the rate so far (None before the first prompt is answered)."""
    if done <= 0:
        return None
    return max(0.0, elapsed_s * (total - done) / done)


class Progress:
    """The trainer's visible state; the loop and the gate tell it what happens."""

    def __init__(
        self,
        policy: str,
        *,
        echo: Callable[[str], None],
        emit: Callable[[TrainerStatus], None] | None = None,
        metrics: TrainerMetrics | None = None,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = now_ms,
    ) -> None:
        self.policy = policy
        self.echo = echo
        self.emit = emit
        self.metrics = metrics
        self.every_s = every_s
        self.clock = clock
        self.wall_ms = wall_ms
        self.state: TrainerState = "training"
        self.version = 0
        self.step = 0
        self.samples = 0
        self.last_step_ms: int | None = None
        self.loss: float | None = None
        self.judging_version: int | None = None
        self.judging_since_ms: int | None = None
        self._judging_t0 = 0.0
        self.done: int | None = None
        self.total: int | None = None
        self.eta: float | None = None
        self.pinned: int | None = None
        self.detail: str | None = None
        self._sent_at = -math.inf
        self._said_at = -math.inf

    # ---- what happens -------------------------------------------------------------------

    def held(
        self, version: int, step: int, detail: str | None = None, *, announce: bool = False
    ) -> None:
        """The trainer holds ``version``'s weights (start, a switch, a rollback);
        ``announce`` sends a status event even when the state did not change."""
        self.version, self.step = version, step
        if detail is not None:
            self.detail = detail
        if self.metrics is not None:
            self.metrics.version.labels(self.policy).set(version)
            self.metrics.step.labels(self.policy).set(step)
        self._set("training" if self.state != "paused" else "paused", force=announce)

    def stepped(
        self, *, step: int, samples: int, loss: float, seconds: float, version: int
    ) -> None:
        """One optimizer step: a line each, an event at most every ``every_s``."""
        self.step, self.version, self.loss = step, version, loss
        self.samples += samples
        self.last_step_ms = self.wall_ms()
        self.echo(
            f"step {step}: loss {loss:.4f}, {samples} samples, {seconds:.2f} s (on v{version})"
        )
        if self.metrics is not None:
            m = self.metrics
            m.step.labels(self.policy).set(step)
            m.samples.labels(self.policy).inc(samples)
            if math.isfinite(loss):
                m.loss.labels(self.policy).set(loss)
            m.last_step.labels(self.policy).set(self.last_step_ms / 1000)
        self._send(due_only=True)

    def judging(self, version: int) -> None:
        self.judging_version, self.judging_since_ms = version, self.wall_ms()
        self._judging_t0 = self.clock()
        self.done = self.total = None
        self.eta = None
        self.echo(
            f"gate v{version}: judging (fresh answers of the live version, the "
            "candidate and the base; progress every "
            f"{self.every_s:g} s)"
        )
        self._said_at = self.clock()
        self._set("judging")

    def answered(self, done: int, total: int, whose: str) -> None:
        """The gate's hook (``Gate.on_progress``): a prompt's fresh answers ended."""
        self.done, self.total = done, total
        self.eta = eta_s(self.clock() - self._judging_t0, done, total)
        if self.metrics is not None:
            m = self.metrics
            m.gate_done.labels(self.policy).set(done)
            m.gate_total.labels(self.policy).set(total)
            m.gate_eta.labels(self.policy).set(self.eta if self.eta is not None else 0.0)
        if self.clock() - self._said_at >= self.every_s:
            self._said_at = self.clock()
            eta = f", ETA {self.eta:.0f} s" if self.eta is not None else ""
            self.echo(f"gate v{self.judging_version}: prompt {done} of {total} ({whose}){eta}")
            self._send(due_only=True)

    def judged(self, version: int, verdict: dict[str, Any] | None, why: str | None) -> None:
        line = (
            verdict_line(version, verdict)
            if verdict is not None
            else f"gate v{version}: no verdict: {why or 'unknown'}"
        )
        self.echo(line)
        self.detail = line
        self.judging_version = self.judging_since_ms = None
        self.done = self.total = None
        self.eta = None
        if self.metrics is not None:
            m = self.metrics
            status = verdict["status"] if verdict is not None else "none"
            m.verdicts.labels(self.policy, status).inc()
            for g in (m.gate_done, m.gate_total, m.gate_eta):
                g.labels(self.policy).set(0)
        self._set("training", force=True)

    def paused(self, pinned: int, line: str) -> None:
        self.pinned = pinned
        self.detail = line
        self.echo(line)
        if self.metrics is not None:
            self.metrics.follows.labels(self.policy, "pause").inc()
        self._set("paused")

    def resumed(self, line: str) -> None:
        self.pinned = None
        self.detail = line
        self.echo(line)
        if self.metrics is not None:
            self.metrics.follows.labels(self.policy, "resume").inc()
        self._set("training")

    def switched(self, version: int, step: int, line: str) -> None:
        self.echo(line)
        if self.metrics is not None:
            self.metrics.follows.labels(self.policy, "switch").inc()
        self.held(version, step, line, announce=True)

    def stopped(self) -> None:
        self._set("stopped")

    # ---- out ----------------------------------------------------------------------------

    def _set(self, state: TrainerState, *, force: bool = False) -> None:
        changed = state != self.state
        self.state = state
        if self.metrics is not None:
            self.metrics.set_state(state)
        if changed or force:
            self._send()

    def event(self) -> TrainerStatus:
        judging = self.state == "judging"
        return TrainerStatus(
            event_id=new_event_id(),
            ts_ms=self.wall_ms(),
            producer=PRODUCER,
            policy_id=self.policy,
            state=self.state,
            version=self.version,
            step=self.step,
            samples=self.samples,
            last_step_ms=self.last_step_ms,
            loss=self.loss if self.loss is None or math.isfinite(self.loss) else None,
            judging_version=self.judging_version if judging else None,
            judging_since_ms=self.judging_since_ms if judging else None,
            prompts_done=self.done if judging else None,
            prompts_total=self.total if judging else None,
            eta_s=self.eta if judging else None,
            pinned_version=self.pinned if self.state == "paused" else None,
            detail=self.detail,
        )

    def _send(self, *, due_only: bool = False) -> None:
        """One ``trainer_status`` event now (``due_only``: unless one went out less than
        ``every_s`` ago). A failed send is logged: status must never stop training."""
        if self.emit is None or (due_only and self.clock() - self._sent_at < self.every_s):
            return
        self._sent_at = self.clock()
        try:
            self.emit(self.event())
        except Exception as exc:  # noqa: BLE001 - a status event is not worth a step
            log.warning("trainer_status not sent: %s", exc)
