"""The canary runner: folds ``liverl.weights.v1`` and ``liverl.samples.v1`` continuously and
sends the decider's decisions (``decider.py``) as ``weights`` events.

It keeps no state of its own. At start it reads both topics from their beginning to their
ends (assign only, no group, no commits), evaluates once, then follows the ends and
evaluates again whenever a poll brought a weights event or a new session outcome. Nothing
is decided before the catch-up: a canary decided before a restart is no longer pending in the
log, and the decision's id (one per version and decider) is not sent again. After each
decision it evaluates again at once (the next pending version may become the canary).

``wait`` is not an event: the weights topic is what every gateway replica follows, and a
wait changes nothing there. Waits are logged (again after ``wait_log_sessions`` new sessions,
or when what is judged changes) and are the metrics (``metrics.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from pipeline import events
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable

from .config import CanarySettings
from .decider import Decider, Step
from .metrics import DecisionMetrics
from .metrics import default as default_metrics
from .reading import sample_outcome

log = logging.getLogger(__name__)
NAN = float("nan")  # a log with more pending versions decides on the next poll


class CanaryRunner:
    """One policy's decider on the broker. ``run(stop)`` catches up, then follows until
    ``stop`` is set (``once``: returns after the catch-up's evaluation)."""

    def __init__(
        self,
        settings: Connectable,
        cfg: CanarySettings,
        *,
        policy_id: str,
        require_promoted: bool,
        namespace: str | None = None,
        metrics: DecisionMetrics | None = None,
        on_step: Callable[[Step], None] | None = None,
    ) -> None:
        self.settings = settings
        self.cfg = cfg
        self.decider = Decider(policy_id, cfg, require_promoted)
        self.namespace = namespace
        self.weights_topic = names.resolve(names.WEIGHTS, namespace)
        self.samples_topic = names.resolve(names.SAMPLES, namespace)
        self.metrics = metrics or default_metrics()
        self.on_step = on_step
        self.sent: list[events.WeightsPublished] = []
        self._producer: Any = None
        self._logged: tuple[Any, ...] | None = None
        self._logged_sessions = 0
        self._counted_sessions = -1

    @property
    def policy_id(self) -> str:
        return self.decider.policy_id

    # -- reading ---------------------------------------------------------------------------

    def handle(self, msg: Any) -> bool:
        """Fold one record of either topic; whether it changed anything."""
        if msg.topic() == self.weights_topic:
            try:
                ev = events.decode(msg.value() or b"", expected_type="weights")
            except events.EventValidationError:
                return False  # the consumers' to dead-letter; a decider skips it
            return isinstance(ev, events.WeightsPublished) and self.decider.add_weights(ev)
        got = sample_outcome(msg.value(), self.policy_id)
        return got is not None and self.decider.add_sample(*got)

    def catch_up(self) -> dict[tuple[str, int], int]:
        """Fold both topics up to their ends; the offsets to follow from."""
        from pipeline.kafka.reader import end_offsets, read_to_end

        topics = [self.weights_topic, self.samples_topic]
        hint = "liverl topics apply" + (f" --namespace {self.namespace}" if self.namespace else "")
        ends = end_offsets(self.settings, topics, group_prefix="liverl-canary-ends", hint=hint)
        read_to_end(self.settings, topics, self.handle, group_prefix="liverl-canary-")
        return ends

    def run(self, stop: threading.Event | None = None, *, once: bool = False) -> None:
        from pipeline.kafka.reader import follow

        ends = self.catch_up()
        log.info(
            "canary decider for %s caught up: %d version(s), %d session(s) with outcomes",
            self.policy_id,
            len(self.decider.log.manifests),
            self.decider.book.count(),
        )
        try:
            self.evaluate()
            if once:
                return

            def batch(msgs: list[Any]) -> None:
                if sum(self.handle(m) for m in msgs):  # every record folded, then judged
                    self.evaluate()

            follow(
                self.settings,
                ends,
                batch,
                stop or threading.Event(),
                group_prefix="liverl-canary-follow",
                label="canary decider",
            )
        finally:
            self.close()

    # -- deciding --------------------------------------------------------------------------

    def evaluate(self) -> list[Step]:
        """Evaluate; send a decision if one is due. The steps taken. A decision sent is folded
        when it is read back from the topic, in log order: folded here at once, it could
        come before an operator's action that the topic holds first."""
        step = self.decider.evaluate()
        self._observe(step)
        if step.event is not None:
            self._send(step)
        self.decider.prune()
        return [step]

    def _send(self, step: Step) -> None:
        ev = step.event
        assert ev is not None and ev.action is not None
        if self._producer is None:
            from pipeline.kafka import EventProducer

            self._producer = EventProducer(self.settings, client_id="liverl-canary")
        self._producer.send(self.weights_topic, ev, key=ev.policy_id)
        self._producer.flush()  # confirmed before anything else is decided on it
        self.decider.mark_sent(ev)  # not sent again before it is read back
        self.sent.append(ev)
        kind, by = ev.action["kind"], ev.action["by"]
        log.warning(
            "%s %s v%d of %s (event %s): %s",
            by,
            kind,
            ev.version,
            ev.policy_id,
            ev.event_id,
            ev.action.get("reason"),
        )
        if by == "canary":
            self.metrics.decisions.labels(self.policy_id, kind).inc()
        else:
            self.metrics.watch_withdrawals.labels(self.policy_id).inc()

    def _observe(self, step: Step) -> None:
        """Metrics for every evaluation; a log line for a wait when it is news."""
        self._gauges(step)
        sessions = self.decider.book.count()
        waiting = step.verdict is not None and step.verdict.kind == "wait"
        if waiting and step.mode == "canary" and sessions != self._counted_sessions:
            self.metrics.decisions.labels(self.policy_id, "wait").inc()
            self._counted_sessions = sessions
        if step.alert:
            self.metrics.watch_alerts.labels(self.policy_id).inc()
            assert step.verdict is not None
            log.warning(
                "watch: v%s of %s dropped against its parent (alert only, "
                "canary.watch_action = alert): %s",
                step.version,
                self.policy_id,
                step.verdict.reason,
            )
        what = (step.mode, step.version, step.reference)
        if waiting and (
            what != self._logged or sessions - self._logged_sessions >= self.cfg.wait_log_sessions
        ):
            assert step.verdict is not None
            self._logged, self._logged_sessions = what, sessions
            log.info(
                "%s v%s of %s: wait (%s)",
                step.mode,
                step.version,
                self.policy_id,
                step.verdict.reason,
            )
        if self.on_step is not None:
            self.on_step(step)

    def _gauges(self, step: Step) -> None:
        m, p = self.metrics, self.policy_id
        f = step.verdict.figures if step.verdict is not None else {}
        canary = step.mode == "canary"
        m.canary_version.labels(p).set((step.version or 0) if canary else 0)
        m.canary_share.labels(p).set((step.share or 0.0) if canary else 0.0)
        if canary:
            for arm in ("canary", "stable"):
                m.sessions.labels(p, arm).set(_num(f.get(f"{arm}_sessions")))
                m.outcome_rate.labels(p, arm).set(_num(f.get(f"{arm}_rate"), NAN))
            m.p_worse.labels(p).set(_num(f.get("p_worse"), NAN))
        if step.mode == "watch":
            for side in ("serving", "parent"):
                m.watch_rate.labels(p, side).set(_num(f.get(f"{side}_rate"), NAN))
            m.watch_p_drop.labels(p).set(_num(f.get("p_drop"), NAN))

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush()


def _num(v: Any, missing: float = 0.0) -> float:
    return float(v) if isinstance(v, int | float) else missing
