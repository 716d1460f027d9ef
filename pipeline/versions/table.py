"""The versions read model: ``liverl.weights.v1`` and ``liverl.serving_status.v1`` folded
into one row per weight version, and the rule that says which version should serve.

Pure functions over events, no Kafka: the gateway's reloader and ``liverl versions`` fold the
same log with the same code, so what the command shows as live is what every replica loads.
The rule, in log order (one partition, so the order is total; a repeated ``event_id`` counts
once):

- the trainer's ``candidate`` announces a version, its ``promoted`` / ``rejected`` verdict
  follows; an operator's ``promote`` makes a version promoted whatever the gate said;
- without a pin the newest servable version serves: not rejected, not withdrawn, promoted
  when the gateways load promoted versions only;
- ``pin N`` serves N until ``unpin``, however new the versions published meanwhile;
- ``rollback`` to N withdraws every version newer than N known at that point, so N (or the
  newest servable one below it) serves until a version published later, or promoted again;
  a version published later whose parent is withdrawn (a trainer's steps on the dropped
  lineage, sent before it read the action) is withdrawn too.

Canary (issue 39): a version whose servable event (the gate's ``promoted`` verdict when the
gateways load promoted versions only, else its ``candidate`` event) carries a
``canary_share`` > 0 is *pending* until a ``rollout``, an operator's ``promote`` or a
``rollback`` to it. The stable version (:meth:`VersionLog.live`) is the newest servable
version that is not pending; the canary (:meth:`VersionLog.canary`) is the oldest servable
pending version newer than it, served to the users whose :func:`arm_fraction` is below its
share (later pending versions wait their turn). ``withdraw`` N withdraws N and every newer
version known, whichever arm serves them; a pin serves the pin alone, no canary. A log
without any ``canary_share`` folds exactly as before.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeline.events import ServingStatus, WeightsPublished

ACTION_KINDS = ("promote", "pin", "unpin", "rollback", "rollout", "withdraw")
Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def arm_fraction(key: str) -> float:
    """Where ``key`` (a user id, else a session id) falls in [0, 1): the first 8 bytes of
    its sha256 as a big-endian integer over 2**64. A request goes to the canary iff this is
    below the canary's share, so a user (or a conversation) stays on one arm for the whole
    canary, every replica agrees without talking, and a larger share only adds users."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def wilson(passed: int, total: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of a pass rate (95 % by default): unlike p ± z·se it stays
    inside [0, 1] and is not zero-width at 0/n or n/n, which is where a new version's first
    few outcomes sit. None when there is nothing to rate."""
    if total <= 0:
        return None
    p = passed / total
    z2 = z * z
    denom = 1 + z2 / total
    centre = (p + z2 / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Action:
    """One operator command as the log holds it: who, when, why."""

    kind: str
    version: int
    by: str
    reason: str | None
    ts_ms: int
    event_id: str
    figures: dict[str, Any] | None = None  # an automatic decision's numbers


@dataclass
class VersionLog:
    """One policy's weights log, folded. Feed it every ``weights`` event in log order."""

    policy_id: str
    manifests: dict[int, WeightsPublished] = field(default_factory=dict)
    status: dict[int, str] = field(default_factory=dict)
    verdicts: dict[int, WeightsPublished] = field(default_factory=dict)  # the gate's event
    overridden: set[int] = field(default_factory=set)  # promoted by an operator
    withdrawn: set[int] = field(default_factory=set)
    # canary_share of the trainer's candidate event / promoted verdict, per version
    candidate_share: dict[int, float] = field(default_factory=dict)
    promoted_share: dict[int, float] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)  # rolled out, promoted or rolled back to
    pinned: int | None = None
    actions: list[Action] = field(default_factory=list)
    events: list[WeightsPublished] = field(default_factory=list)  # this policy's, deduplicated
    _seen: set[str] = field(default_factory=set)
    _announced: set[int] = field(default_factory=set)  # versions with a trainer event

    def add(self, ev: WeightsPublished) -> bool:
        """Fold one event; False when it is another policy's or a repeat of one seen."""
        if ev.policy_id != self.policy_id or ev.event_id in self._seen:
            return False
        self._seen.add(ev.event_id)
        self.events.append(ev)
        v = ev.version
        self.manifests.setdefault(v, ev)
        if ev.action is None:
            if v not in self._announced:
                self._announced.add(v)
                # A version trained on from a withdrawn one (steps a trainer published after
                # a withdraw or rollback it had not read yet) is withdrawn with it: else the
                # lineage the action dropped would serve again as the next version.
                if ev.parent is not None and ev.parent in self.withdrawn:
                    self.withdrawn.add(v)
            share = ev.canary_share or 0.0
            if ev.status in ("promoted", "rejected"):
                self.verdicts[v] = ev
                if v not in self.overridden:
                    self.status[v] = ev.status
                if ev.status == "promoted" and share > 0:
                    self.promoted_share.setdefault(v, share)
            else:
                self.status.setdefault(v, "candidate")
                if share > 0:
                    self.candidate_share.setdefault(v, share)
            return True
        kind = str(ev.action.get("kind"))
        figures = ev.action.get("figures")
        self.actions.append(
            Action(
                kind,
                v,
                str(ev.action.get("by")),
                ev.action.get("reason"),
                ev.ts_ms,
                ev.event_id,
                figures if isinstance(figures, dict) else None,
            )
        )
        self.status.setdefault(v, ev.status)
        if kind == "promote":
            self.status[v] = "promoted"
            self.overridden.add(v)
            self.withdrawn.discard(v)
            self.released.add(v)
        elif kind == "pin":
            self.pinned = v
        elif kind == "unpin":
            self.pinned = None
        elif kind == "rollback":
            self.withdrawn |= {u for u in self.manifests if u > v}
            self.withdrawn.discard(v)
            self.released.add(v)
        elif kind == "rollout":  # a withdrawn version stays withdrawn: only promote restores
            self.released.add(v)
        elif kind == "withdraw":
            self.withdrawn |= {u for u in self.manifests if u >= v}
        return True

    @property
    def last_action_id(self) -> str | None:
        """The newest operator action's event id (None before any)."""
        return self.actions[-1].event_id if self.actions else None

    def servable_since(self, version: int, require_promoted: bool) -> int:
        """When ``version`` became servable (a canary's start): its promoted verdict's time
        when the gateways load promoted versions only (and it has one), else its first
        event's."""
        verdict = self.verdicts.get(version)
        if require_promoted and verdict is not None:
            return verdict.ts_ms
        return self.manifests[version].ts_ms

    def servable(self, version: int, require_promoted: bool) -> bool:
        """Whether the no-pin rule may serve ``version``."""
        status = self.status.get(version)
        return (
            version in self.manifests
            and version not in self.withdrawn
            and status != "rejected"
            and (status == "promoted" or not require_promoted)
        )

    def share(self, version: int, require_promoted: bool) -> float:
        """The canary share its servable event carried (0: none): the gate's promoted
        verdict's when only promoted versions serve, else the candidate event's."""
        shares = self.promoted_share if require_promoted else self.candidate_share
        return shares.get(version, 0.0)

    def pending(self, version: int, require_promoted: bool) -> bool:
        """Whether ``version`` is a canary (or waits to be one): its servable event had a
        share, and no rollout, promote or rollback to it has happened."""
        return version not in self.released and self.share(version, require_promoted) > 0

    def preference(self, require_promoted: bool, failed: Iterable[int] = ()) -> list[int]:
        """The versions to try for the stable arm, best first: the pin alone while pinned (a
        pin never falls back to another version), else every servable version that is not
        pending, newest first. ``failed`` (versions a replica could not load) are left out."""
        bad = set(failed)
        if self.pinned is not None:
            return [self.pinned] if self.pinned in self.manifests and self.pinned not in bad else []
        return [
            v
            for v in sorted(self.manifests, reverse=True)
            if v not in bad
            and self.servable(v, require_promoted)
            and not self.pending(v, require_promoted)
        ]

    def live(self, require_promoted: bool) -> int | None:
        """The stable version: what serves everyone outside the canary (None: the base
        model, nothing servable)."""
        order = self.preference(require_promoted)
        return order[0] if order else None

    def canary(self, require_promoted: bool) -> tuple[int, float] | None:
        """(version, share): the oldest servable pending version newer than the stable one
        (later ones wait their turn), None when there is none or while pinned."""
        if self.pinned is not None:
            return None
        stable = self.live(require_promoted)
        for v in sorted(self.manifests):
            if (
                (stable is None or v > stable)
                and self.servable(v, require_promoted)
                and self.pending(v, require_promoted)
            ):
                return v, self.share(v, require_promoted)
        return None

    def previous(self, require_promoted: bool) -> int | None:
        """What ``rollback`` with no ``--to`` goes back to: the newest servable version older
        than the live one."""
        live = self.live(require_promoted)
        if live is None:
            return None
        older = [v for v in self.preference(require_promoted) if v < live]
        return older[0] if older else None


def fold(policy_id: str, weights: Iterable[WeightsPublished]) -> VersionLog:
    log = VersionLog(policy_id)
    for ev in weights:
        log.add(ev)
    return log


@dataclass(frozen=True)
class Served:
    """When a version served, from the replicas' reload reports."""

    since_ms: int | None = None
    until_ms: int | None = None  # None while some replica still serves it
    replicas: tuple[str, ...] = ()  # replicas whose latest report (on an arm) is this version
    canary_on: tuple[str, ...] = ()  # of those, the ones serving it as their canary arm


def served(policy_id: str, statuses: Iterable[ServingStatus]) -> dict[int, Served]:
    """version -> when it served: since its first successful load on any replica (either
    arm), until the first successful load of another version on an arm it served, after its
    last load (None while a replica's newest report on some arm is still this version).
    Failed reloads change nothing."""
    ok = sorted(
        (s for s in statuses if s.policy_id == policy_id and s.ok),
        key=lambda s: (s.ts_ms, s.replica_id),
    )
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    arms: dict[int, set[str]] = {}
    current: dict[tuple[str, str], int] = {}
    for s in ok:
        first.setdefault(s.version, s.ts_ms)
        last[s.version] = s.ts_ms
        arms.setdefault(s.version, set()).add(s.arm)
        current[(s.replica_id, s.arm)] = s.version
    out: dict[int, Served] = {}
    for v, since in first.items():
        on = tuple(sorted({r for (r, _arm), cv in current.items() if cv == v}))
        # a dropped canary arm reports the stable version: that is no canary
        canary_on = tuple(
            sorted(
                r
                for (r, arm), cv in current.items()
                if cv == v and arm == "canary" and current.get((r, "stable")) != v
            )
        )
        later = [s.ts_ms for s in ok if s.version != v and s.arm in arms[v] and s.ts_ms >= last[v]]
        until = None if on or not later else min(later)
        out[v] = Served(since, until, on, canary_on)
    return out


@dataclass(frozen=True)
class OutcomeRate:
    """Sessions served by a version that have a verified outcome, and how many passed."""

    passed: int
    total: int

    @property
    def rate(self) -> float | None:
        return self.passed / self.total if self.total else None

    @property
    def interval(self) -> tuple[float, float] | None:
        return wilson(self.passed, self.total)


def outcome_rates(
    policy_id: str, samples: Iterable[tuple[str, int, str, float | None]]
) -> dict[int, OutcomeRate]:
    """version -> outcome rate, from ``(policy_id, behavior_weight_version, session_id,
    outcome)`` of samples: a sample's outcome is its session's verified outcome (> 0
    passed), so a session counts once per version whatever its number of turns; the last
    outcome seen wins (a later test run restates it)."""
    by: dict[tuple[int, str], float] = {}
    for policy, version, session, outcome in samples:
        if policy == policy_id and outcome is not None and not math.isnan(outcome):
            by[(version, session)] = outcome
    tally: dict[int, list[int]] = {}
    for (version, _session), outcome in by.items():
        t = tally.setdefault(version, [0, 0])
        t[0] += outcome > 0
        t[1] += 1
    return {v: OutcomeRate(p, n) for v, (p, n) in tally.items()}


GATE_FIGURES = (
    "gate_won",
    "gate_lost",
    "gate_tied",
    "gate_probe_correct",
    "gate_live_probe_correct",
    "gate_probe_n",
    "gate_fluency",
    "gate_live_fluency",
    "gate_live_version",
)


def rows(
    log: VersionLog,
    serving: dict[int, Served] | None = None,
    outcomes: dict[int, OutcomeRate] | None = None,
    *,
    require_promoted: bool = False,
) -> list[dict[str, Any]]:
    """One plain dict per version, oldest first (``list --format json`` prints them as they
    are): manifest figures, the gate's verdict and figures, serving times, outcome rate."""
    serving = serving or {}
    outcomes = outcomes or {}
    live = log.live(require_promoted)
    canary = log.canary(require_promoted)
    out = []
    for v in sorted(log.manifests):
        m = log.manifests[v]
        parent_step = (
            0
            if m.parent is None  # trained from the base
            else log.manifests[m.parent].step
            if m.parent in log.manifests
            else None
        )
        verdict = log.verdicts.get(v)
        gate = {
            k: verdict.metrics[k]
            for k in GATE_FIGURES
            if verdict is not None and k in verdict.metrics
        }
        s = serving.get(v, Served())
        o = outcomes.get(v)
        interval = o.interval if o is not None else None
        out.append(
            {
                "version": v,
                "parent": m.parent,
                "step": m.step,
                "steps": m.step - parent_step if parent_step is not None else None,
                "samples": m.metrics.get("samples"),
                "method": m.metrics.get("method"),
                "status": log.status.get(v, m.status),
                "gate": gate,
                "gate_ts_ms": verdict.ts_ms if verdict is not None else None,
                "published_ms": m.ts_ms,
                "served_since_ms": s.since_ms,
                "served_until_ms": s.until_ms,
                "replicas": list(s.replicas),
                "canary_replicas": list(s.canary_on),
                "outcomes": None
                if o is None
                else {
                    "passed": o.passed,
                    "total": o.total,
                    "rate": o.rate,
                    "ci95": list(interval) if interval is not None else None,
                },
                "size_bytes": sum(int(f["bytes"]) for f in m.files),
                "uri": m.uri,
                "live": v == live,
                # the share of users it serves as the canary now (None: not the canary)
                "canary": canary[1] if canary is not None and canary[0] == v else None,
                # a canary, or waiting its turn as one (a pin or an older canary first)
                "pending": (
                    v not in log.withdrawn
                    and log.servable(v, require_promoted)
                    and log.pending(v, require_promoted)
                ),
                "pinned": v == log.pinned,
                "withdrawn": v in log.withdrawn,
            }
        )
    return out


def lineage(log: VersionLog, version: int) -> list[int]:
    """``version``, its parent, the parent's parent… down to the oldest known (the base
    is not listed)."""
    chain: list[int] = []
    v: int | None = version
    while v is not None and v in log.manifests and v not in chain:
        chain.append(v)
        v = log.manifests[v].parent
    return chain
