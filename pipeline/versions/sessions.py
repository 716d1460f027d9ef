"""Sessions with an outcome per version, folded from the samples topic as they arrive, for
the canary decider and the regression watch.

A session's outcome is its verified one (a gate, a test run, explicit feedback) when it has
one; else the mean of its turns' judged scores (``reading.sample_outcome``'s ``judged``: the
reward of the user's reply or another next state, without the path part), so a deployment
whose sessions are only chats still compares its arms. A mean of exactly 0 (every turn
neutral) is no outcome. Rates are ``table.outcome_rates`` over the book's rows (a session
once per version, > 0 passed). What the book adds is *when*: a session's time is its first
counted sample's ``ts_ms``, which is what "since the canary began" and "the last N sessions"
select by. Sample times, not arrival order: a restarted decider, which reads the partitions in
another interleaving, selects the same sessions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .table import OutcomeRate, outcome_rates


@dataclass
class _Signals:
    """What one session of one version has shown so far."""

    verified: float | None = None  # the newest verified outcome
    # turn -> judged score: a sample read twice (a catch-up overlapping the follow, a
    # redelivery) replaces its turn's score instead of counting again
    judged: dict[int, float] = field(default_factory=dict)

    def outcome(self) -> float | None:
        if self.verified is not None:
            return self.verified
        if not self.judged:
            return None
        mean = sum(self.judged.values()) / len(self.judged)
        return mean if mean != 0 else None


@dataclass
class SessionBook:
    """One policy's sessions with outcomes: version -> session -> (first ts_ms, outcome)."""

    policy_id: str
    by_version: dict[int, dict[str, tuple[int, float]]] = field(default_factory=dict)
    _signals: dict[tuple[int, str], _Signals] = field(default_factory=dict, repr=False)

    def add(
        self,
        policy_id: str,
        version: int,
        session: str,
        outcome: float | None,
        ts_ms: int,
        judged: float | None = None,
        turn: int = 0,
    ) -> bool:
        """Fold one sample's verified outcome and judged score; False when the session's
        outcome is unchanged (another policy's sample, nothing to count, or the same)."""
        if policy_id != self.policy_id:
            return False
        verified = None if outcome is None or math.isnan(outcome) else outcome
        score = None if judged is None or not math.isfinite(judged) else judged
        if verified is None and score is None:
            return False
        key = (version, session)
        signals = self._signals.get(key)
        if signals is None:
            signals = self._signals[key] = _Signals()
        before = signals.outcome()
        if verified is not None:
            signals.verified = verified
        if score is not None:
            signals.judged[turn] = score
        after = signals.outcome()
        if after == before:
            return False
        sessions = self.by_version.setdefault(version, {})
        if after is None:
            sessions.pop(session, None)
        else:
            sessions[session] = (sessions[session][0] if session in sessions else ts_ms, after)
        return True

    def _rate(self, version: int, chosen: list[tuple[str, float]]) -> OutcomeRate:
        rows = [(self.policy_id, version, sid, outcome) for sid, outcome in chosen]
        return outcome_rates(self.policy_id, rows).get(version, OutcomeRate(0, 0))

    def rate(
        self,
        version: int,
        since_ms: int | None = None,
        excluding: Sequence[tuple[int, int | None]] = (),
    ) -> OutcomeRate:
        """The version's sessions, those that began at ``since_ms`` or later if given, and
        outside every ``[start, end)`` period of ``excluding`` (end None: still open)."""
        sessions = self.by_version.get(version, {})

        def outside(ts: int) -> bool:
            return not any(start <= ts and (end is None or ts < end) for start, end in excluding)

        return self._rate(
            version,
            [
                (sid, o)
                for sid, (ts, o) in sessions.items()
                if (since_ms is None or ts >= since_ms) and outside(ts)
            ],
        )

    def window(self, version: int, last: int) -> OutcomeRate:
        """The version's ``last`` most recent sessions (by first sample time, then id)."""
        sessions = self.by_version.get(version, {})
        newest = sorted(sessions.items(), key=lambda kv: (kv[1][0], kv[0]), reverse=True)
        return self._rate(version, [(sid, o) for sid, (_ts, o) in newest[:last]])

    def count(self) -> int:
        return sum(len(s) for s in self.by_version.values())

    def keep_only(self, versions: Iterable[int]) -> int:
        """Forget every other version's sessions (the decider compares a few versions at a
        time: without this the book grew with every session ever served); how many
        sessions were forgotten."""
        keep = set(versions)
        gone = [v for v in self.by_version if v not in keep]
        dropped = sum(len(self.by_version.pop(v)) for v in gone)
        for key in [k for k in self._signals if k[0] not in keep]:
            del self._signals[key]
        return dropped
