"""What the canary runner decides, from what it has folded: no Kafka here.

State is the policy's weights log (``VersionLog``) and its sessions with outcomes
(``SessionBook``). One evaluation:

- pinned: nothing (a pin is the operator's; the fold has no canary while pinned);
- a canary runs: ``canary.decide`` on the canary's sessions against the stable version's
  sessions since the canary became servable; rollout or withdraw becomes an event by ``canary``;
- else, a stable version serves: ``watch.check`` on its last window of sessions against its
  parent's; a drop becomes a withdraw event by ``watch`` (or an alert, no event, with
  ``watch_action = "alert"``).

A decision event's id derives from the version and the decider alone (``decision_id``): one
decision per version and decider, whatever it says and whenever it is taken, so a restarted
runner, which may reach its decision at another session than the first run did, sends the id
already in the log, and every reader counts an id once. The runner also finds it in the log
and does not send it at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipeline import __version__
from pipeline.events import Producer, WeightsPublished, derive_event_id

from . import canary as canary_rule
from . import watch as watch_rule
from .actions import manifest_action
from .canary import Verdict
from .config import CanarySettings
from .sessions import SessionBook
from .table import VersionLog

PRODUCER = Producer(component="canary", version=__version__)
ID_VERSION = "decision-1"  # bump if the id's inputs change
BASE = 0  # the version samples of the base model carry (behavior_weight_version)

Mode = Literal["idle", "pinned", "canary", "watch"]
Deciders = Literal["canary", "watch"]


def arms(log: VersionLog, require_promoted: bool) -> tuple[int | None, tuple[int, float] | None]:
    """(stable version or None for the base, canary (version, share) or None), as the fold
    says: the one place the decider reads the canary interface."""
    return log.live(require_promoted), log.canary(require_promoted)


def pinned_periods(log: VersionLog) -> list[tuple[int, int | None]]:
    """``[pin, unpin)`` times of the log's pins (end None while pinned): every user met the
    pinned version then, so those sessions belong to no canary arm."""
    periods: list[tuple[int, int | None]] = []
    start: int | None = None
    for a in log.actions:
        if a.kind == "pin" and start is None:
            start = a.ts_ms
        elif a.kind == "unpin" and start is not None:
            periods.append((start, a.ts_ms))
            start = None
    if start is not None:
        periods.append((start, None))
    return periods


def arm_version(version: int | None) -> int:
    """The ``behavior_weight_version`` of the samples a version (None: the base) answered."""
    return BASE if version is None else version


def decision_id(policy_id: str, version: int, by: Deciders, parents: list[str]) -> str:
    return derive_event_id("weights_decision", parents, ID_VERSION, policy_id, version, by)


def decision_event(
    log: VersionLog,
    kind: Literal["rollout", "withdraw"],
    version: int,
    *,
    by: Deciders,
    reason: str,
    figures: dict[str, canary_rule.Figure],
    ts_ms: int | None = None,
) -> WeightsPublished:
    """The ``weights`` event of a decision: the version's manifest with ``action = {kind,
    by, reason, figures}``, as an operator's action copies it (``actions.action_event``). Its
    parent is the version's first event (the candidate's), which every reader has."""
    parents = [log.manifests[version].event_id]
    return manifest_action(
        log,
        version,
        event_id=decision_id(log.policy_id, version, by, parents),
        parents=parents,
        producer=PRODUCER,
        ts_ms=ts_ms,
        action={"kind": kind, "by": by, "reason": reason, "figures": figures},
    )


@dataclass(frozen=True)
class Step:
    """One evaluation: what was judged, the verdict, and the event to send (None: nothing
    to send, e.g. waiting, or the decision is in the log already). ``alert``: the watch found
    a drop it only reports (``watch_action = "alert"``), the first time for this version."""

    mode: Mode
    version: int | None = None  # the canary, or the serving version the watch judged
    reference: int | None = None  # the stable arm's version, or the parent (0: the base)
    share: float | None = None
    verdict: Verdict | None = None
    event: WeightsPublished | None = None
    alert: bool = False


@dataclass
class Decider:
    """The folded state and one evaluation at a time (see the module docstring)."""

    policy_id: str
    cfg: CanarySettings
    require_promoted: bool
    log: VersionLog = field(init=False)
    book: SessionBook = field(init=False)
    alerted: set[int] = field(default_factory=set)  # versions alerted on (this process)
    _ids: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.log = VersionLog(self.policy_id)
        self.book = SessionBook(self.policy_id)

    def add_weights(self, ev: WeightsPublished) -> bool:
        """Fold one ``weights`` event (any policy's; others change nothing)."""
        if not self.log.add(ev):
            return False
        self._ids.add(ev.event_id)
        return True

    def add_sample(
        self,
        version: int,
        session: str,
        outcome: float | None,
        ts_ms: int,
        judged: float | None = None,
        turn: int = 0,
    ) -> bool:
        """Fold one sample of this policy (``reading.sample_outcome``'s fields)."""
        return self.book.add(self.policy_id, version, session, outcome, ts_ms, judged, turn)

    def prune(self) -> int:
        """Forget the sessions of versions no evaluation can look at again: what is kept is
        every version not withdrawn from the stable one on (the stable and its parent, the
        canary and the versions waiting behind it) and the base's (version 0). A later
        rollback to an older version starts its watch window afresh. Sessions forgotten."""
        stable, _canary = arms(self.log, self.require_promoted)
        floor = stable if stable is not None else 0
        parent = self.log.manifests[stable].parent if stable in self.log.manifests else None
        keep = {0, floor, arm_version(parent)} | {
            v for v in self.log.manifests if v > floor and v not in self.log.withdrawn
        }
        # sessions of versions not announced yet (samples can arrive before the event)
        keep |= {v for v in self.book.by_version if v not in self.log.manifests}
        return self.book.keep_only(keep)

    def mark_sent(self, ev: WeightsPublished) -> None:
        """A decision this process sent: not decided again while it travels to the topic and
        back (it is folded when read, in log order)."""
        self._ids.add(ev.event_id)

    def _unsent(self, ev: WeightsPublished) -> WeightsPublished | None:
        return None if ev.event_id in self._ids else ev

    def evaluate(self, ts_ms: int | None = None) -> Step:
        stable, canary = arms(self.log, self.require_promoted)
        if self.log.pinned is not None:
            return Step("pinned", self.log.pinned)
        if canary is not None:
            return self._canary(stable, *canary, ts_ms=ts_ms)
        if stable is None:
            return Step("idle")
        return self._watch(stable, ts_ms=ts_ms)

    def _canary(self, stable: int | None, version: int, share: float, *, ts_ms: int | None) -> Step:
        ref = arm_version(stable)
        # both arms over the same period: since the canary became servable (its servable
        # event's time), whether or not any replica managed to serve it
        since = self.log.servable_since(version, self.require_promoted)
        pinned = pinned_periods(self.log)  # no arms then: everyone met the pin
        stable_arm = self.book.rate(ref, since_ms=since, excluding=pinned)
        verdict = canary_rule.decide(
            self.book.rate(version, excluding=pinned), stable_arm, self.cfg, share
        )
        figures = {
            **verdict.figures,
            "canary_version": version,
            "stable_version": ref,
            "canary_share": share,
            "since_ms": since,
        }
        verdict = Verdict(verdict.kind, verdict.reason, figures)
        event = None
        if verdict.kind != "wait":
            event = self._unsent(
                decision_event(
                    self.log,
                    verdict.kind,
                    version,
                    by="canary",
                    reason=verdict.reason,
                    figures=figures,
                    ts_ms=ts_ms,
                )
            )
        return Step("canary", version, ref, share, verdict, event)

    def _watch(self, stable: int, *, ts_ms: int | None) -> Step:
        parent = arm_version(self.log.manifests[stable].parent)
        n = self.cfg.watch_window
        verdict = watch_rule.check(
            self.book.window(stable, n), self.book.window(parent, n), self.cfg
        )
        verdict = Verdict(
            verdict.kind,
            verdict.reason,
            {**verdict.figures, "serving_version": stable, "parent_version": parent},
        )
        if verdict.kind != "withdraw":
            return Step("watch", stable, parent, verdict=verdict)
        if self.cfg.watch_action == "alert":
            first = stable not in self.alerted
            self.alerted.add(stable)
            return Step("watch", stable, parent, verdict=verdict, alert=first)
        event = self._unsent(
            decision_event(
                self.log,
                "withdraw",
                stable,
                by="watch",
                reason=verdict.reason,
                figures=verdict.figures,
                ts_ms=ts_ms,
            )
        )
        return Step("watch", stable, parent, verdict=verdict, event=event)
