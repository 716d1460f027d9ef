"""The consistency processor: joins judges' verdicts to outcomes as they arrive and publishes
each match, with the judge's running tally, on ``liverl.judge_consistency.v1``.

It runs beside the workers (``liverl judges watch``), reads ``prm_scores`` and
``next_states`` with assign only, and keeps no state of its own: at start it reads both
topics from their beginning (their retention bounds the evidence) and the consistency topic
to learn which matches were already published, publishes the ones that were not (a stop
between a match and its send), then follows the topics' ends. Match ids derive from the
verdict and the outcome, so a match published twice (a crash between send and the next
start) is one event to every consumer that deduplicates by id.

A verdict whose turn's outcomes disagree with each other is published once more, as
``contradicted: true`` with the tally that no longer counts it either way (its id derives
from the verdict alone, so it is one event whichever outcome contradicted it, live or
rebuilt at a restart). ``contradictions`` on each event counts the judge's contradicted
verdicts, also served as ``liverl_judge_contradicted``.

A judge is *flagged* (``flagged: true`` on the match that did it, the
``liverl_judge_flags_total`` counter) when its *recent* consistency (over its last ``window``
decided matches, ``processors.consistency_window``) falls below ``flag_below`` once it has
``min_decided`` decided verdicts in all: the cumulative figure of a long-right judge would
take as many wrong verdicts as it had right ones to get there. A flagged judge is *excluded*
(``excluded: true`` on every event until it recovers): panels and the promotion gate give it
weight 0. It *recovers* (``recovered: true`` on the match that did it, one event) when its
recent consistency is back at ``flag_below + FLAG_HYSTERESIS``: without the margin a judge
near the threshold would flap in and out of the panel, changing its version at each turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline import events
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable

from .consistency import RECENT_WINDOW, ConsistencyTracker, JudgeKey, Match, outcome_vote

log = logging.getLogger(__name__)
VERSION = "consistency-1"  # in every match id: change the join rules, change it
FLAG_HYSTERESIS = 0.05
PRODUCER = events.Producer(component="consistency", version=VERSION)


@dataclass
class History:
    """Verdicts and outcomes read from the topics' history."""

    verdicts: list[events.PrmScore] = field(default_factory=list)
    outcomes: list[events.NextState] = field(default_factory=list)
    undecodable: int = 0


def read_history(
    settings: Connectable, namespace: str | None, idle_timeout_s: float = 30.0
) -> History:
    """Every verdict and every outcome-carrying next state of the namespace (None: live),
    from the topics' beginning to their ends now, with assign only."""
    from pipeline.kafka.reader import read_to_end

    found = History()

    def collect(msg: Any) -> None:
        try:
            ev = events.decode(msg.value() or b"")
        except Exception:  # noqa: BLE001 - counted and shown, never fatal
            found.undecodable += 1
            return
        if isinstance(ev, events.PrmScore):
            found.verdicts.append(ev)
        elif isinstance(ev, events.NextState) and outcome_vote(ev) is not None:
            found.outcomes.append(ev)

    read_to_end(
        settings,
        [names.resolve(names.PRM_SCORES, namespace), names.resolve(names.NEXT_STATES, namespace)],
        collect,
        group_prefix="liverl-consistency",
        idle_timeout_s=idle_timeout_s,
    )
    return found


def match_event(
    m: Match, change: Change | None = None, excluded: bool = False
) -> events.JudgeConsistency:
    """The event of one match, with the judge's tally as it stood right after it, the change
    of its state this match made (if any) and whether it stands excluded after it."""
    assert m.tally is not None  # a match the tracker made
    t = m.tally
    parents = [m.verdict_id, m.outcome_id]
    # A verdict is contradicted once, by whichever outcome: one id (a rebuild at a restart
    # may name another outcome than the live run did).
    event_id = (
        events.derive_event_id("judge_consistency", [m.verdict_id], VERSION, "contradicted")
        if m.contradicted  # fmt: skip
        else events.derive_event_id("judge_consistency", parents, VERSION)
    )
    return events.JudgeConsistency(
        event_id=event_id,
        producer=PRODUCER,
        parents=parents,
        judge_id=m.judge[0],
        judge_version=m.judge[1],
        verdict=m.verdict,
        outcome=m.outcome,
        verdict_id=m.verdict_id,
        outcome_id=m.outcome_id,
        agree=t.agree,
        disagree=t.disagree,
        abstain=t.abstain,
        consistency=t.consistency,
        flagged=change is not None and change.kind == "flagged",
        recovered=change is not None and change.kind == "recovered",
        reason=None if change is None else change.reason,
        contradicted=m.contradicted,
        contradictions=t.contradicted,
        recent_agree=t.recent_agree,
        recent_disagree=t.recent_disagree,
        recent_consistency=t.recent_consistency,
        window=t.window,
        excluded=excluded,
    )


@dataclass(frozen=True, slots=True)
class Change:
    """A judge's state changed at a match: ``flagged`` (out) or ``recovered`` (back in)."""

    kind: Literal["flagged", "recovered"]
    reason: str


@dataclass
class Flagger:
    """Decides which match flags its judge and which brings it back (see the module
    docstring); :attr:`flagged` holds the judges excluded now."""

    flag_below: float = 0.5
    min_decided: int = 10
    flagged: set[JudgeKey] = field(default_factory=set)

    def check(self, m: Match) -> Change | None:
        """The change ``m`` makes to its judge's state; None for all but the two matches
        that cross the thresholds."""
        assert m.tally is not None
        t = m.tally
        recent = t.recent_consistency
        figures = (
            f"recent {recent:.3f} over the last {len(t.recent)} decided "
            f"({t.recent_agree} agree), cumulative {t.consistency:.3f} after "
            f"{t.decided} ({t.agree} agree, {t.disagree} disagree)"
        )
        if m.judge in self.flagged:
            back = self.flag_below + FLAG_HYSTERESIS
            if recent >= back:
                self.flagged.discard(m.judge)
                return Change("recovered", f"{figures}; >= {back:g}")
            return None
        if t.decided >= self.min_decided and recent < self.flag_below:
            self.flagged.add(m.judge)
            return Change("flagged", f"{figures}; < {self.flag_below:g}")
        return None


class ConsistencyWatcher:
    """One process's join. ``run(stop)`` catches up, then follows until ``stop`` is set
    (``once``: returns after the catch-up)."""

    def __init__(
        self,
        settings: Connectable,
        *,
        namespace: str | None = None,
        flag_below: float = 0.5,
        min_decided: int = 10,
        window: int = RECENT_WINDOW,
        on_event: Callable[[events.JudgeConsistency], None] | None = None,
        horizon_s: float = 7 * 86_400.0,
    ) -> None:
        self.settings = settings
        self.namespace = namespace
        self.tracker = ConsistencyTracker(window=window)
        self.flagger = Flagger(flag_below, min_decided)
        self.inputs = [
            names.resolve(names.PRM_SCORES, namespace),
            names.resolve(names.NEXT_STATES, namespace),
        ]
        self.output = names.resolve(names.JUDGE_CONSISTENCY, namespace)
        self.published: set[str] = set()
        self.sent = 0
        self.contradicted = 0  # contradicted matches published (a retraction or not)
        self.on_event = on_event
        self._producer: Any = None
        self.horizon_ms = int(horizon_s * 1000)  # sessions quiet longer are forgotten
        self._forgot_at = 0.0

    # -- catching up -----------------------------------------------------------------------

    def _ends(self) -> dict[tuple[str, int], int]:
        from pipeline.kafka.reader import end_offsets

        hint = "liverl topics apply" + (f" --namespace {self.namespace}" if self.namespace else "")
        return end_offsets(
            self.settings, self.inputs, group_prefix="liverl-consistency-ends", hint=hint
        )

    def catch_up(self) -> dict[tuple[str, int], int]:
        """Rebuild the join from history; publish what was never published. Returns the
        offsets to follow from."""
        from pipeline.kafka.reader import read_to_end

        ends = self._ends()
        read_to_end(
            self.settings,
            [self.output],
            lambda m: self.published.add(_event_id(m.value())),
            group_prefix="liverl-consistency-published",
        )
        history = read_history(self.settings, self.namespace)
        self._publish(self.tracker.feed(history.verdicts, history.outcomes))
        # From here every match involves an event past the ends: none was published before.
        self.published.clear()
        self._forget(force=True)
        return ends

    def _forget(self, force: bool = False) -> None:
        """At most once a minute: drop sessions quiet for longer than the horizon."""
        if not force and time.monotonic() - self._forgot_at < 60.0:
            return
        self._forgot_at = time.monotonic()
        dropped = self.tracker.forget_before(events.now_ms() - self.horizon_ms)
        if dropped:
            log.info(
                "consistency: forgot %d session(s) quiet for over %.0f h; %d kept",
                dropped,
                self.horizon_ms / 3_600_000,
                self.tracker.sessions,
            )

    # -- following -----------------------------------------------------------------------

    def handle(self, ev: events.Event | None) -> list[Match]:
        if isinstance(ev, events.PrmScore):
            return self.tracker.verdict(ev)
        if isinstance(ev, events.NextState):
            return self.tracker.outcome(ev)
        return []

    def run(self, stop: threading.Event | None = None, *, once: bool = False) -> None:
        from pipeline.kafka.reader import follow

        ends = self.catch_up()
        if once:
            self.close()
            return

        def batch(msgs: list[Any]) -> None:
            self._publish([m for msg in msgs for m in self.handle(decode_or_none(msg.value()))])
            self._forget()

        try:
            follow(
                self.settings,
                ends,
                batch,
                stop or threading.Event(),
                group_prefix="liverl-consistency-follow",
                label="consistency reader",
            )
        finally:
            self.close()

    # -- publishing ------------------------------------------------------------------------

    def _publish(self, matches: list[Match]) -> None:
        if not matches:
            return
        if self._producer is None:
            from pipeline.kafka import EventProducer

            self._producer = EventProducer(self.settings, client_id="liverl-consistency")
        for ev in self.match_events(matches):
            _metrics(ev)
            if ev.event_id in self.published:
                continue  # published (and said) before a restart: said once
            if ev.flagged or ev.recovered:
                log.warning(
                    "judge %s (%s) %s: %s",
                    ev.judge_id,
                    ev.judge_version,
                    "flagged" if ev.flagged else "recovered",
                    ev.reason,
                )
            self._producer.send(self.output, ev, key=ev.judge_id)
            self.published.add(ev.event_id)
            self.sent += 1
            self.contradicted += ev.contradicted
            if self.on_event is not None:
                self.on_event(ev)
        self._producer.flush()

    def match_events(self, matches: list[Match]) -> list[events.JudgeConsistency]:
        """The events of ``matches`` in order, each with the flag state it leaves."""
        out = []
        for m in matches:
            change = self.flagger.check(m)
            out.append(match_event(m, change, m.judge in self.flagger.flagged))
        return out

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush()


def decode_or_none(raw: bytes | None) -> events.Event | None:
    try:
        return events.decode(raw or b"")
    except Exception:  # noqa: BLE001 - another component's bad record is theirs to report
        return None


def _event_id(raw: bytes | None) -> str:
    ev = decode_or_none(raw)
    return ev.event_id if ev is not None else ""


_GAUGE: Any = None
_RECENT: Any = None
_EXCLUDED: Any = None
_FLAGS: Any = None
_CONTRADICTED: Any = None


def _metrics(ev: events.JudgeConsistency) -> None:
    """``liverl_judge_consistency``, ``liverl_judge_recent_consistency``,
    ``liverl_judge_excluded`` and ``liverl_judge_contradicted`` per judge and version;
    ``liverl_judge_flags_total``."""
    global _GAUGE, _RECENT, _EXCLUDED, _FLAGS, _CONTRADICTED
    from prometheus_client import Counter, Gauge

    if _GAUGE is None:
        _GAUGE = Gauge(
            "liverl_judge_consistency",
            "A judge's agreement with outcomes: (agree + 1) / (agree + disagree + 2)",
            ["judge_id", "judge_version"],
        )
        _RECENT = Gauge(
            "liverl_judge_recent_consistency",
            "The same over the judge's last window decided matches (what flagging reads)",
            ["judge_id", "judge_version"],
        )
        _EXCLUDED = Gauge(
            "liverl_judge_excluded",
            "1 while a judge is flagged: out of panels and the promotion gate",
            ["judge_id", "judge_version"],
        )
        _FLAGS = Counter(
            "liverl_judge_flags",
            "Times a judge fell below the flag threshold",
            ["judge_id", "judge_version"],
        )
        _CONTRADICTED = Gauge(
            "liverl_judge_contradicted",
            "A judge's verdicts on turns whose "
            "outcomes disagree with each other (counted neither way)",
            ["judge_id", "judge_version"],
        )
    _GAUGE.labels(ev.judge_id, ev.judge_version).set(ev.consistency)
    if ev.recent_consistency is not None:
        _RECENT.labels(ev.judge_id, ev.judge_version).set(ev.recent_consistency)
    _EXCLUDED.labels(ev.judge_id, ev.judge_version).set(int(ev.excluded))
    _CONTRADICTED.labels(ev.judge_id, ev.judge_version).set(ev.contradictions)
    if ev.flagged:
        _FLAGS.labels(ev.judge_id, ev.judge_version).inc()
