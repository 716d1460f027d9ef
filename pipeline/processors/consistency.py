"""Judge consistency (RLAnything): how often a judge's verdicts agree with the verifiable
outcomes that later arrive for the same turn.

A verdict (``prm_score``) on turn t of session s *agrees* when an outcome of that turn
(a next state with an explicit ``score`` or an ``exit_code``: a quality gate, a test run,
thumbs feedback) has the same sign, *disagrees* when the sign is opposite, and is an
*abstention* when the verdict is 0. A session-scoped outcome (``record-outcome`` without
``--turn``) stands for every turn of its session that has no outcome of its own. When the
outcomes it is checked against disagree with each other (passed and failed, thumbs up and
down), the verdict is *contradicted*: there is no truth to check it against, so it counts
neither way. Otherwise whoever can post outcomes could post both signs on a turn and have the
later one count against every judge. A verdict
that was made *from* the outcome itself (its parents name the outcome's event) is skipped:
a judge reading an exit code agrees with it by construction and would look perfect. A user
asking the question again (``detail.repeats_question``, set by pairing) is an outcome too,
-1, and a verdict read from that very reply still counts: recognising a repeat is the test.

The score is the posterior mean of agreement under a uniform prior,
``consistency = (agree + 1) / (agree + disagree + 2)``: 0.5 with no evidence, so a new judge
is neither trusted nor distrusted, and one lucky verdict moves it only to 2/3. Beside it, the
*recent* consistency is the same mean over the judge's last ``window`` decided matches
(:data:`RECENT_WINDOW`): the cumulative figure of a judge right 200 times falls below 0.5 only
after 201 wrong verdicts in a row, the recent one (window 20) after 11, so flagging reads it.

A judge's weight in a vote (the panel, the promotion gate) is :func:`log_odds_weight` of its
consistency, ``max(0, log(p / (1 - p)))``: the weight under which a weighted majority of
independent judges is the most likely answer, so a coin-flip judge (0.5) weighs nothing and two
of them cannot outvote one judge at 0.9.

Pure and incremental: :class:`ConsistencyTracker` takes verdicts and outcomes in any order
(they are different topics) and returns each match once, so a streaming consumer and the
``liverl judges compare`` batch read share it. A match is made as soon as an outcome is
known; an outcome of the other sign arriving later turns it into a contradiction, returned as
a second match of the same verdict that takes the first back out of the tally, and a turn's
own outcome arriving after its session's re-matches the verdict from the turn the same way
(the one rule of both commands: a turn's verdict is checked against its turn's outcomes
when the turn has any).

A panel's verdict (``prm_score.members``) also counts as one verdict of each member, under
the member's own judge id and version (match id ``<prm_score id>/<member judge_id>``): the
panel is weighted by those tallies, so each member must be tallied by its own votes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pipeline.events import NextState, PrmScore
from pipeline.events.types import Vote

from .rewards import is_session_outcome
from .verification import outcome_sign

JudgeKey = tuple[str, str]  # (judge_id, judge_version)
RECENT_WINDOW = 20  # decided matches in a judge's recent consistency (the watcher's default)
WEIGHT_EPS = 1e-3  # a consistency is clipped into [eps, 1 - eps] before its log-odds


def log_odds_weight(p: float, eps: float = WEIGHT_EPS) -> float:
    """A judge's vote weight from its consistency ``p``: ``max(0, log(p / (1 - p)))`` with
    ``p`` clipped into [eps, 1 - eps] (a perfect record would weigh infinitely). Log-odds add
    up as evidence does, so 0.5 weighs 0 and a judge worse than a coin weighs 0 too (never a
    negative weight: its votes are not read backwards)."""
    q = min(max(p, eps), 1.0 - eps)
    return max(0.0, math.log(q / (1.0 - q)))


def outcome_vote(state: NextState) -> Vote | None:
    """The verifiable outcome a next state carries: :func:`verification.outcome_sign` (the
    sign of its explicit score, else +1 for exit code 0 and -1 for any other code; None for
    exit 124/126/127 and a read-only terminal command), else -1 for a user asking the question
    again, else None (any other reply is evidence, not an outcome)."""
    if state.score is not None or state.exit_code is not None:
        return outcome_sign(state)
    if state.kind == "user_reply" and (state.detail or {}).get("repeats_question") is True:
        return -1  # asked again: the answer did not answer (processors/pairing.py)
    return None


@dataclass(slots=True)
class Tally:
    """Agreement counts of one judge (and version), and whether each of its last ``window``
    decided matches agreed (oldest first; compared by the counts only)."""

    agree: int = 0
    disagree: int = 0
    abstain: int = 0
    contradicted: int = 0  # verdicts whose outcomes disagreed with each other: counted neither way
    window: int = field(default=RECENT_WINDOW, compare=False)
    recent: deque[tuple[str, bool]] = field(default_factory=deque, compare=False, repr=False)

    def add(self, match: Match) -> None:
        if match.contradicted:
            self.contradicted += 1
            return
        self._count(match.agrees, 1)
        if match.agrees is not None:
            self.recent.append((match.verdict_id, match.agrees))
            while len(self.recent) > self.window:
                self.recent.popleft()

    def retract(self, agrees: bool | None, verdict_id: str) -> None:
        """Take back a match that counted ``agrees`` (its turn turned out contradicted), and
        out of the recent window if it is still there (the window is then one shorter until
        the next decided match)."""
        self._count(agrees, -1)
        if agrees is not None and (verdict_id, agrees) in self.recent:
            self.recent.remove((verdict_id, agrees))

    def _count(self, agrees: bool | None, n: int) -> None:
        if agrees is None:
            self.abstain += n
        elif agrees:
            self.agree += n
        else:
            self.disagree += n

    def copy(self) -> Tally:
        return Tally(
            self.agree,
            self.disagree,
            self.abstain,
            self.contradicted,
            self.window,
            deque(self.recent),
        )

    @property
    def decided(self) -> int:
        return self.agree + self.disagree

    @property
    def consistency(self) -> float:
        """(agree + 1) / (agree + disagree + 2): the posterior mean under a uniform prior."""
        return (self.agree + 1) / (self.decided + 2)

    @property
    def recent_agree(self) -> int:
        return sum(1 for _, agrees in self.recent if agrees)

    @property
    def recent_disagree(self) -> int:
        return len(self.recent) - self.recent_agree

    @property
    def recent_consistency(self) -> float:
        """The same posterior mean over the last ``window`` decided matches only."""
        return (self.recent_agree + 1) / (len(self.recent) + 2)

    @property
    def agreement(self) -> float | None:
        """The raw share of decided verdicts that agreed (None before any)."""
        return self.agree / self.decided if self.decided else None


@dataclass(frozen=True, slots=True)
class Match:
    """One verdict joined to its outcome (``contradicted``: to outcomes that disagree)."""

    judge: JudgeKey
    session_id: str
    turn: int
    verdict: Vote
    outcome: Vote
    verdict_id: str
    outcome_id: str
    tally: Tally | None = None  # the judge's counts right after this match (None: unmatched)
    # The outcomes of the turn disagree with each other (``outcome_id`` is one of them): the
    # verdict counts neither way, and a match of it returned before is out of ``tally``.
    contradicted: bool = False

    @property
    def agrees(self) -> bool | None:
        """True agrees, False disagrees, None an abstention (verdict 0) or contradicted."""
        if self.contradicted or self.verdict == 0:
            return None
        return self.verdict == self.outcome


@dataclass(slots=True)
class _Verdict:
    judge: JudgeKey
    score: Vote
    event_id: str
    evidence: frozenset[str]  # the verdict's parents: the interaction and its next state
    # Where it stands: unmatched (None), matched from the outcomes of ``source`` (a turn's or
    # its session's), or contradicted (final for those outcomes: both signs never agree
    # again; a turn's own outcome after a session's still re-matches it from the turn).
    status: Literal["matched", "contradicted"] | None = None
    source: _Key | None = None
    agrees: bool | None = None  # what it counted, while matched


@dataclass(slots=True)
class _Outcome:
    vote: Vote
    event_id: str
    ts_ms: int
    # Read from words (a repeated question), not stated: a judge that read the same reply
    # had to understand it, so its verdict is a fair test and is not skipped.
    read: bool = False


_Key = tuple[str, int] | str  # the outcomes of (session, turn), or of a session as a whole


@dataclass(slots=True)
class _Outcomes:
    """The outcomes of one turn (or one session): the latest of each sign, which is all the
    join needs (the latest outcome, and whether both signs were seen)."""

    latest: dict[Vote, _Outcome] = field(default_factory=dict)

    @property
    def contradictory(self) -> bool:
        return len(self.latest) > 1

    def add(self, o: _Outcome) -> bool:
        """Keep ``o`` if it is the latest of its sign; True if it made the two signs meet."""
        old = self.latest.get(o.vote)
        if old is None or (o.ts_ms, o.event_id) >= (old.ts_ms, old.event_id):
            self.latest[o.vote] = o
        return old is None and self.contradictory

    def against(self, v: _Verdict) -> _Outcome | None:
        """The latest outcome ``v`` may be checked against: not one it was made from."""
        fair = [o for o in self.latest.values() if o.read or o.event_id not in v.evidence]
        return max(fair, key=lambda o: (o.ts_ms, o.event_id), default=None)


@dataclass
class ConsistencyTracker:
    """Joins verdicts to outcomes as either arrives; :attr:`tallies` per judge key.

    A verdict is matched to its turn's latest outcome if the turn has one, else to its
    session's; an outcome of the same sign arriving later does not re-count it (the first
    verifiable word decides). A turn's own outcome arriving after a session's matched (or
    contradicted) the verdict re-matches it from the turn: its earlier match leaves the tally
    and a new match names the turn's outcome, so the live join ends where the batch read
    (``liverl judges compare``, the watcher's catch-up) does, in any order of arrival. An
    outcome of the other sign among those it was matched from makes the verdict
    contradicted: its match is taken out of the tally and a contradicted match says so. A
    verdict first matchable once its outcomes disagree is contradicted at once.
    :attr:`contradictory` counts the turns (or sessions, for session outcomes) whose outcomes
    came to disagree.
    """

    tallies: dict[JudgeKey, Tally] = field(default_factory=dict)
    contradictory: int = 0
    window: int = RECENT_WINDOW  # of each tally's recent consistency
    _verdicts: dict[str, dict[int, list[_Verdict]]] = field(default_factory=dict)  # by session
    _turn_outcomes: dict[tuple[str, int], _Outcomes] = field(default_factory=dict)
    _session_outcomes: dict[str, _Outcomes] = field(default_factory=dict)
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
                mine.append(
                    _Verdict(
                        (str(m["judge_id"]), str(m["judge_version"])), m["vote"], vid, evidence
                    )
                )
        self._verdicts.setdefault(prm.session_id, {}).setdefault(prm.turn, []).extend(mine)
        return self._match_all(prm.session_id, prm.turn, mine)

    def outcome(self, state: NextState) -> list[Match]:
        """Record a next state; the matches it completes or contradicts (none unless it is
        an outcome)."""
        recorded = self._record(state)
        if recorded is None:
            return []
        out = self._contradict(state.session_id, *recorded)
        turns = self._verdicts.get(state.session_id, {})
        if is_session_outcome(state):
            return out + [
                m
                for turn, verdicts in turns.items()
                for m in self._match_all(state.session_id, turn, verdicts)
            ]
        return out + self._match_all(state.session_id, state.turn, turns.get(state.turn, []))

    def feed(self, verdicts: Iterable[PrmScore], states: Iterable[NextState]) -> list[Match]:
        """Batch form: every verdict and next state (order does not matter for the totals,
        except which of several outcomes of one sign on a turn is named: the latest by event
        time). Verdicts recorded before are contradicted by ``states`` as :meth:`outcome`
        would; they are not matched to them."""
        out: list[Match] = []
        for s in states:
            if (recorded := self._record(s)) is not None:
                out += self._contradict(s.session_id, *recorded)
        return out + [m for prm in verdicts for m in self.verdict(prm)]

    # -- inner workings ------------------------------------------------------------------------

    def _record(self, state: NextState) -> tuple[_Key, _Outcome, bool] | None:
        """Keep a new outcome among its turn's (or session's): the key it is kept under, it,
        and whether it made the two signs meet there; None if it is no outcome (or seen)."""
        vote = outcome_vote(state)
        if vote is None or state.event_id in self._seen:
            return None
        self._touch(state.session_id, state.ts_ms, state.event_id)
        read = state.score is None and state.exit_code is None
        o = _Outcome(vote, state.event_id, state.ts_ms, read)
        key: _Key
        if is_session_outcome(state):
            key = state.session_id
            outcomes = self._session_outcomes.setdefault(key, _Outcomes())
        else:
            key = (state.session_id, state.turn)
            self._outcome_turns.setdefault(state.session_id, set()).add(state.turn)
            outcomes = self._turn_outcomes.setdefault(key, _Outcomes())
        met = outcomes.add(o)
        self.contradictory += met
        return key, o, met

    def _outcomes(self, key: _Key) -> _Outcomes | None:
        if isinstance(key, str):
            return self._session_outcomes.get(key)
        return self._turn_outcomes.get(key)

    def _outcome_for(
        self, sid: str, turn: int, v: _Verdict
    ) -> tuple[_Key, _Outcomes, _Outcome] | None:
        for key in ((sid, turn), sid):
            outcomes = self._outcomes(key)
            o = outcomes.against(v) if outcomes is not None else None
            if o is not None:
                assert outcomes is not None
                return key, outcomes, o
        return None

    def _match_all(self, sid: str, turn: int, verdicts: Sequence[_Verdict]) -> list[Match]:
        """Match the verdicts not matched yet, and re-match from the turn's own outcomes
        those matched (or contradicted) from their session's: the batch read, which knows
        every outcome before any verdict, matches them so, and the live join must agree."""
        out = []
        for v in verdicts:
            found = self._outcome_for(sid, turn, v)
            if found is None:
                continue
            key, outcomes, o = found
            if v.status is not None:
                if not (isinstance(v.source, str) and isinstance(key, tuple)):
                    continue  # matched already from these outcomes: the first word decides
                t = self.tallies[v.judge]
                if v.status == "contradicted":
                    t.contradicted -= 1
                else:
                    t.retract(v.agrees, v.event_id)
            out.append(self._match(sid, turn, v, key, o, outcomes.contradictory))
        return out

    def _contradict(self, sid: str, key: _Key, o: _Outcome, met: bool) -> list[Match]:
        """When ``o`` made the outcomes under ``key`` disagree: every verdict matched from
        them becomes contradicted, its match taken out of its judge's tally."""
        if not met:
            return []
        turns = self._verdicts.get(sid, {})
        scope = turns.items() if isinstance(key, str) else [(key[1], turns.get(key[1], []))]
        out = []
        for turn, verdicts in scope:
            for v in verdicts:
                if v.status == "matched" and v.source == key:
                    self.tallies[v.judge].retract(v.agrees, v.event_id)
                    out.append(self._match(sid, turn, v, key, o, True))
        return out

    def _match(
        self, sid: str, turn: int, v: _Verdict, key: _Key, o: _Outcome, contradicted: bool
    ) -> Match:
        m = Match(
            v.judge, sid, turn, v.score, o.vote, v.event_id, o.event_id, contradicted=contradicted
        )
        v.status = "contradicted" if contradicted else "matched"
        v.source, v.agrees = key, m.agrees
        t = self.tallies.setdefault(v.judge, Tally(window=self.window))
        t.add(m)
        return dataclasses.replace(m, tally=t.copy())


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
