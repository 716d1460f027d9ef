"""Next states posted for a turn (sources, hooks): a cap per kind and no repeats.

Every next state is judged, and a turn's judge score is the mean of its verdicts, so a harness
that posts the same screen 200 times, or 200 slightly different ones, outweighs the user's own
reply (issue 37: 200 error-dialog posts gave 205 verdicts and a reward of -0.96 against a
"thanks, perfect!"). Feedback is bounded downstream (one vote per caller and turn); posted next
states are bounded here, per (session, turn, channel) where the channel is the source or hook
that built them:

- a post whose next states equal ones already recorded for the turn (same kind, content,
  score, detail; who sent it and the harness's call ids aside) records nothing and is answered
  with the first one's ids: a retry, or a flood of one payload, counts once. Not for a source
  whose repeats are observations (``repeats_count``: the gui source, where an action repeated
  with nothing changing is what the path rules penalise); the cap still holds for those;
- at most ``cap`` distinct next states of a channel per turn: beyond, 429
  ``next_states_per_turn``, nothing recorded.

The ledger is this replica's (bounded, least recently used first out): behind N replicas a
turn may take N times the cap.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from pipeline import events

from .errors import ApiError

# Who posted and which call it was: not part of what a next state says.
IDENTITY_FIELDS = frozenset({"key_id", "user_id", "generation_id", "conversation_id"})

Key = tuple[str, int, str]  # session, turn, channel


def meaning(ns: events.NextState) -> str:
    """A digest of what a next state tells the judges."""
    detail = {k: v for k, v in ns.detail.items() if k not in IDENTITY_FIELDS}
    doc: dict[str, Any] = {
        "kind": ns.kind,
        "role": ns.role,
        "content": ns.content,
        "exit_code": ns.exit_code,
        "score": ns.score,
        "scope": ns.scope,
        "detail": detail,
    }
    raw = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS, default=str)
    return hashlib.sha256(raw).hexdigest()[:32]


@dataclass
class _Turn:
    ids: dict[str, str] = field(default_factory=dict)  # meaning -> the recorded event's id


class PostedStates:
    """What this replica recorded from posts, per (session, turn, channel)."""

    def __init__(self, cap: int, max_turns: int = 100_000) -> None:
        self.cap = cap
        self.max_turns = max_turns
        self._turns: OrderedDict[Key, _Turn] = OrderedDict()

    def check_room(self, session_id: str, turn: int, channel: str, adding: int = 1) -> None:
        """429 when ``adding`` more next states would take the turn past the cap."""
        held = self._turns.get((session_id, turn, channel))
        have = len(held.ids) if held is not None else 0
        if have + adding > self.cap:
            raise ApiError(
                429,
                f"turn {turn} of session {session_id!r} already has {have} {channel} next "
                f"state(s) from posts, the most a turn takes (serve.next_states_per_turn = "
                f"{self.cap}); nothing recorded",
                type="rate_limit_error",
                param="turn",
                code="next_states_per_turn",
            )

    def split(
        self, channel: str, states: Sequence[events.NextState], *, dedupe: bool = True
    ) -> tuple[list[events.NextState], dict[str, str]]:
        """The states to record (new ones, the cap checked: 429 for the whole post beyond
        it) and, for each repeat, its id -> the id recorded before (none without
        ``dedupe``)."""
        fresh: list[events.NextState] = []
        repeats: dict[str, str] = {}
        adding: dict[Key, dict[str, str]] = {}  # meaning -> id, of this post's new states
        for ns in states:
            key, digest = (ns.session_id, ns.turn, channel), meaning(ns)
            held = self._turns.get(key)
            new = adding.setdefault(key, {})
            if dedupe and held is not None and digest in held.ids:
                repeats[ns.event_id] = held.ids[digest]
            elif dedupe and digest in new:  # the same next state twice in one post
                repeats[ns.event_id] = new[digest]
            else:
                new[digest + ("" if dedupe else ns.event_id)] = ns.event_id
                fresh.append(ns)
        for (sid, turn, ch), new in adding.items():
            if new:
                self.check_room(sid, turn, ch, len(new))
        return fresh, repeats

    def add(self, channel: str, states: Sequence[events.NextState], *, dedupe: bool = True) -> None:
        """Remember recorded ``states`` (each counts against the cap; without ``dedupe``
        none is a repeat of another)."""
        for ns in states:
            key = (ns.session_id, ns.turn, channel)
            held = self._turns.pop(key, None) or _Turn()
            held.ids.setdefault(meaning(ns) + ("" if dedupe else ns.event_id), ns.event_id)
            self._turns[key] = held
        while len(self._turns) > self.max_turns:
            self._turns.popitem(last=False)
