"""Judge consistency (RLAnything): how often a judge's verdicts agree with the verifiable
outcomes that later arrive for the same turn.

A verdict (``prm_score``) on turn t of session s is *confirmed* when an outcome of that turn
(a next state with an explicit ``score`` or an ``exit_code``: a quality gate, a test run,
thumbs feedback) has the same sign, *contradicted* when the sign is opposite, and an
*abstention* when the verdict is 0. A session-scoped outcome (``record-outcome`` without
``--turn``) stands for every turn of its session that has no outcome of its own. A verdict
that was made *from* the outcome itself (its parents name the outcome's event) is skipped:
a judge reading an exit code agrees with it by construction and would look perfect. A user
asking the question again (``detail.repeats_question``, set by pairing) is an outcome too,
-1, and a verdict read from that very reply still counts: recognising a repeat is the test.

The score is the posterior mean of agreement under a uniform prior,
``consistency = (agree + 1) / (agree + disagree + 2)``: 0.5 with no evidence, so a new judge
is neither trusted nor distrusted, and one lucky verdict moves it only to 2/3.

Pure and incremental: :class:`ConsistencyTracker` takes verdicts and outcomes in any order
(they are different topics) and returns each match once, so a streaming consumer and the
``liverl judges compare`` batch read share it.

A panel's verdict (``prm_score.members``) also counts as one verdict of each member, under
the member's own judge id and version (match id ``<prm_score id>/<member judge_id>``): the
panel is weighted by those tallies, so each member must be tallied by its own votes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.events import NextState, PrmScore
from pipeline.events.types import Vote

from .judges import sign
from .rewards import is_session_outcome

JudgeKey = tuple[str, str]  # (judge_id, judge_version)


def outcome_vote(state: NextState) -> Vote | None:
    """The verifiable outcome a next state carries: the sign of its explicit score, else +1
    for exit code 0 and -1 for any other code, else -1 for a user asking the question again,
    else None (any other reply is evidence, not an outcome)."""
    if state.score is not None:
        s = sign(state.score)
        return s if s != 0 else None
    if state.exit_code is not None:
        return 1 if state.exit_code == 0 else -1
    if state.kind == "user_reply" and (state.detail or {}).get("repeats_question") is True:
        return -1  # asked again: the answer did not answer (processors/pairing.py)
    return None


@dataclass(slots=True)
class Tally:
    """Agreement counts of one judge (and version)."""

    agree: int = 0
    disagree: int = 0
    abstain: int = 0

    def add(self, match: Match) -> None:
        a = match.agrees
        if a is None:
            self.abstain += 1
        elif a:
            self.agree += 1
        else:
            self.disagree += 1

    @property
    def decided(self) -> int:
        return self.agree + self.disagree

    @property
    def consistency(self) -> float:
        """(agree + 1) / (agree + disagree + 2): the posterior mean under a uniform prior."""
        return (self.agree + 1) / (self.decided + 2)

    @property
    def agreement(self) -> float | None:
        """The raw share of decided verdicts that agreed (None before any)."""
        return self.agree / self.decided if self.decided else None


@dataclass(frozen=True, slots=True)
class Match:
    """One verdict joined to its outcome."""

    judge: JudgeKey
    session_id: str
    turn: int
    verdict: Vote
    outcome: Vote
    verdict_id: str
    outcome_id: str
    tally: Tally | None = None  # the judge's counts right after this match (None: unmatched)

    @property
    def agrees(self) -> bool | None:
        """True confirmed, False contradicted, None an abstention (verdict 0)."""
        return None if self.verdict == 0 else self.verdict == self.outcome


@dataclass(slots=True)
class _Verdict:
    judge: JudgeKey
    score: Vote
    event_id: str
    evidence: frozenset[str]  # the verdict's parents: the interaction and its next state


@dataclass(slots=True)
class _Outcome:
    vote: Vote
    event_id: str
    ts_ms: int
    # Read from words (a repeated question), not stated: a judge that read the same reply
    # had to understand it, so its verdict is a fair test and is not skipped.
    read: bool = False


@dataclass
class ConsistencyTracker:
    """Joins verdicts to outcomes as either arrives; :attr:`tallies` per judge key.

    A verdict is matched at most once: to its turn's latest outcome if one is known when it
    is first matchable, else to its session's; an outcome arriving later for an already
    matched verdict does not re-count it (the first verifiable word on a turn decides).
    """

    tallies: dict[JudgeKey, Tally] = field(default_factory=dict)
    _verdicts: dict[str, dict[int, list[_Verdict]]] = field(default_factory=dict)  # by session
    _turn_outcomes: dict[tuple[str, int], _Outcome] = field(default_factory=dict)
    _session_outcomes: dict[str, _Outcome] = field(default_factory=dict)
    _matched: set[str] = field(default_factory=set)
    _seen: set[str] = field(default_factory=set)
    _last: dict[str, int] = field(default_factory=dict)  # session -> newest event time (ms)
    _ids: dict[str, list[str]] = field(default_factory=dict)  # session -> its ids in _seen
    _outcome_turns: dict[str, set[int]] = field(default_factory=dict)

    def forget_before(self, ts_ms: int) -> int:
        """Drop what is kept of sessions whose newest event is older than ``ts_ms`` (the
        tallies stay): the watcher's memory bound. An outcome arriving for a forgotten
        session finds no verdict to match. Returns the sessions dropped."""
        old = [sid for sid, t in self._last.items() if t < ts_ms]
        for sid in old:
            for eid in self._ids.pop(sid, []):
                self._seen.discard(eid)
                self._matched.discard(eid)
            self._verdicts.pop(sid, None)
            self._session_outcomes.pop(sid, None)
            for turn in self._outcome_turns.pop(sid, ()):
                self._turn_outcomes.pop((sid, turn), None)
            del self._last[sid]
        return len(old)

    def _touch(self, sid: str, ts_ms: int, event_id: str) -> None:
        self._seen.add(event_id)
        self._ids.setdefault(sid, []).append(event_id)
        self._last[sid] = max(self._last.get(sid, ts_ms), ts_ms)

    @property
    def sessions(self) -> int:
        return len(self._last)

    def verdict(self, prm: PrmScore) -> list[Match]:
        """Record a verdict, and each panel member's vote in it as a verdict of that member;
        the matches they make now, if their outcome is known."""
        if prm.event_id in self._seen or prm.error is not None:
            return []  # a redelivery; a failed judgement is no verdict
        self._touch(prm.session_id, prm.ts_ms, prm.event_id)
        evidence = frozenset(prm.parents)
        mine = [_Verdict((prm.judge_id, prm.judge_version), prm.score, prm.event_id, evidence)]
        for m in prm.members or ():
            vid = member_verdict_id(prm.event_id, str(m["judge_id"]))
            if vid not in self._seen:
                self._touch(prm.session_id, prm.ts_ms, vid)
                mine.append(_Verdict((str(m["judge_id"]), str(m["judge_version"])),
                                     m["vote"], vid, evidence))
        self._verdicts.setdefault(prm.session_id, {}).setdefault(prm.turn, []).extend(mine)
        out = []
        for v in mine:
            found = self._outcome_for(prm.session_id, prm.turn, v)
            if found:
                out.append(self._match(prm.session_id, prm.turn, v, found))
        return out

    def outcome(self, state: NextState) -> list[Match]:
        """Record a next state; the matches it completes (none unless it is an outcome)."""
        if not self._record(state):
            return []
        turns = self._verdicts.get(state.session_id, {})
        if is_session_outcome(state):
            return [m for turn, verdicts in turns.items()
                    for m in self._match_all(state.session_id, turn, verdicts)]
        return self._match_all(state.session_id, state.turn, turns.get(state.turn, []))

    def feed(self, verdicts: Iterable[PrmScore], states: Iterable[NextState]) -> list[Match]:
        """Batch form: every verdict and next state (order does not matter for the totals,
        except which of several outcomes of one turn counts: the latest by event time)."""
        for s in states:
            self._record(s)
        return [m for prm in verdicts for m in self.verdict(prm)]

    # -- inner workings ------------------------------------------------------------------------

    def _record(self, state: NextState) -> bool:
        """Keep a new outcome as its turn's (or session's) latest; False if it is none."""
        vote = outcome_vote(state)
        if vote is None or state.event_id in self._seen:
            return False
        self._touch(state.session_id, state.ts_ms, state.event_id)
        read = state.score is None and state.exit_code is None
        o = _Outcome(vote, state.event_id, state.ts_ms, read)
        table: dict[Any, _Outcome] = self._turn_outcomes
        key: Any = (state.session_id, state.turn)
        if is_session_outcome(state):
            table, key = self._session_outcomes, state.session_id
        else:
            self._outcome_turns.setdefault(state.session_id, set()).add(state.turn)
        old = table.get(key)
        if old is None or (o.ts_ms, o.event_id) >= (old.ts_ms, old.event_id):
            table[key] = o
        return True

    def _outcome_for(self, sid: str, turn: int, v: _Verdict) -> _Outcome | None:
        for o in (self._turn_outcomes.get((sid, turn)), self._session_outcomes.get(sid)):
            if o is not None and (o.read or o.event_id not in v.evidence):
                return o
        return None

    def _match_all(self, sid: str, turn: int, verdicts: Sequence[_Verdict]) -> list[Match]:
        out = []
        for v in verdicts:
            if v.event_id in self._matched:
                continue
            o = self._outcome_for(sid, turn, v)
            if o is not None:
                out.append(self._match(sid, turn, v, o))
        return out

    def _match(self, sid: str, turn: int, v: _Verdict, o: _Outcome) -> Match:
        self._matched.add(v.event_id)
        m = Match(v.judge, sid, turn, v.score, o.vote, v.event_id, o.event_id)
        t = self.tallies.setdefault(v.judge, Tally())
        t.add(m)
        return dataclasses.replace(m, tally=Tally(t.agree, t.disagree, t.abstain))


def member_verdict_id(prm_id: str, judge_id: str) -> str:
    """The id a panel member's vote is matched under: its panel verdict's id and its name."""
    return f"{prm_id}/{judge_id}"


def weighted_plurality(votes: Sequence[tuple[Vote | None, float]]) -> Vote:
    """The vote with the largest total weight (None votes ignored); a tie for first place, or
    no positive weight, gives 0. With equal weights this is the PRM's plain plurality."""
    totals: dict[Vote, float] = {}
    for vote, weight in votes:
        if vote is not None and weight > 0:
            totals[vote] = totals.get(vote, 0.0) + weight
    if not totals:
        return 0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    if len(ranked) > 1 and abs(ranked[0][1] - ranked[1][1]) <= 1e-12:
        return 0
    return ranked[0][0]
