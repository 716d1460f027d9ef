"""Sessions with a verified outcome per version, folded from the samples topic as they
arrive, for the canary decider and the regression watch.

Rates are ``table.outcome_rates`` over the book's rows (a session once per version, its last
outcome seen wins, > 0 passed). What the book adds is *when*: a session's time is its first
sample's ``ts_ms`` (the sample of its first outcome-carrying turn), which is what "since the
canary began" and "the last N sessions" select by. Sample times, not arrival order: a
restarted decider, which reads the partitions in another interleaving, selects the same
sessions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .table import OutcomeRate, outcome_rates


@dataclass
class SessionBook:
    """One policy's sessions with outcomes: version -> session -> (first ts_ms, outcome)."""

    policy_id: str
    by_version: dict[int, dict[str, tuple[int, float]]] = field(default_factory=dict)

    def add(self, policy_id: str, version: int, session: str, outcome: float | None,
            ts_ms: int) -> bool:
        """Fold one sample's outcome; False when it changes nothing (another policy's, no
        outcome, or the outcome already known)."""
        if policy_id != self.policy_id or outcome is None or math.isnan(outcome):
            return False
        sessions = self.by_version.setdefault(version, {})
        known = sessions.get(session)
        if known is not None and known[1] == outcome:
            return False
        sessions[session] = (ts_ms if known is None else known[0], outcome)
        return True

    def _rate(self, version: int, chosen: list[tuple[str, float]]) -> OutcomeRate:
        rows = [(self.policy_id, version, sid, outcome) for sid, outcome in chosen]
        return outcome_rates(self.policy_id, rows).get(version, OutcomeRate(0, 0))

    def rate(self, version: int, since_ms: int | None = None) -> OutcomeRate:
        """The version's sessions, those that began at ``since_ms`` or later if given."""
        sessions = self.by_version.get(version, {})
        return self._rate(version, [(sid, o) for sid, (ts, o) in sessions.items()
                                    if since_ms is None or ts >= since_ms])

    def window(self, version: int, last: int) -> OutcomeRate:
        """The version's ``last`` most recent sessions (by first sample time, then id)."""
        sessions = self.by_version.get(version, {})
        newest = sorted(sessions.items(), key=lambda kv: (kv[1][0], kv[0]), reverse=True)
        return self._rate(version, [(sid, o) for sid, (_ts, o) in newest[:last]])

    def first_ms(self, version: int) -> int | None:
        """When the version's first session with an outcome began (None: none yet)."""
        sessions = self.by_version.get(version)
        return min(ts for ts, _o in sessions.values()) if sessions else None

    def count(self) -> int:
        return sum(len(s) for s in self.by_version.values())
