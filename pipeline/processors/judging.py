"""Judge stage logic: match next states to their turns, judge, and build the output events.

Pure state handling (a typed :class:`JudgeState` per session, which the session table's
JSON, `state_json.py`, round-trips exactly) plus one async call into the judge. The state
functions may update the state they are given in place and return it, so callers always go on
with the returned object. A next state for a turn not seen yet waits up to the grace period
(interactions and next states are different topics, so either may be read first), then goes to
the DLQ with the reason.

The per-session state is a changelog value, so it is bounded whatever the traffic: each turn
keeps only the last ``text_chars`` characters of its request and answer (the LLM judge reads
the last 4,000), and the oldest turns are dropped while the state would take more than
``max_bytes`` of JSON. A next state for a dropped turn waits and is dead-lettered like one for
an unknown turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pipeline.events import Hint, Interaction, NextState, PrmScore, Producer, derive_event_id

from .judges import Judge, TurnContext, Verdict, as_vote
from .rewards import is_session_outcome
from .state_json import StateJson

log = logging.getLogger(__name__)
TEXT_CHARS = 4_096  # defaults of ProcessorSettings.state_text_chars / state_max_bytes
STATE_BYTES = 1 << 20

JUDGE_COMPONENT = "judge"  # the producer of verdicts and their hints


@dataclass(slots=True)
class JudgeTurn:
    """What the judge needs of a trainable main turn (texts already cut to ``text_chars``)."""

    event_id: str
    request: str
    answer: str


@dataclass(slots=True)
class Pending:
    """A next state waiting for its turn: since when (processing time), and which turn."""

    since_ms: int
    turn: int


@dataclass(slots=True)
class JudgeState:
    """One session's judge state; ``JudgeState()`` is a session not seen yet."""

    turns: dict[int, JudgeTurn] = field(default_factory=dict)  # by turn number
    pending: dict[str, Pending] = field(default_factory=dict)  # by next-state id


# Sizes are measured as the session table serialises them (state_json.py).
_STATE_JSON = StateJson(JudgeState)


@dataclass
class JudgeWork:
    """A next state whose turn is known: ready to be judged."""

    ctx: TurnContext
    interaction_id: str
    state: NextState


@dataclass
class JudgeOutput:
    prm: PrmScore
    hints: list[Hint] = field(default_factory=list)


def on_interaction(
    state: JudgeState | None,
    inter: Interaction,
    *,
    text_chars: int = TEXT_CHARS,
    max_bytes: int = STATE_BYTES,
) -> JudgeState:
    """Remember what the judge needs of a trainable main turn, within the bounds above."""
    state = JudgeState() if state is None else state
    if inter.turn_type == "side" or not inter.train:
        return state
    ctx = TurnContext.from_interaction(inter)
    state.turns[inter.turn] = JudgeTurn(
        inter.event_id, ctx.request[-text_chars:], ctx.answer[-text_chars:]
    )
    # Everything but the turns (the state with none: it counts their braces twice, harmlessly).
    rest = len(_STATE_JSON.dump(JudgeState(pending=state.pending)))
    _newest_that_fit(state.turns, max_bytes - rest, inter)
    return state


def _newest_that_fit(turns: dict[int, JudgeTurn], budget: int, inter: Interaction) -> None:
    """Drop the oldest turns (in place) until the rest encode within ``budget`` bytes."""
    # "<turn>": value, per turn, in braces
    sizes = {t: len(str(t)) + 4 + len(StateJson.dump(v)) for t, v in turns.items()}
    total = sum(sizes.values()) + 2
    for t in sorted(turns):
        if total <= budget:
            break
        total -= sizes[t]
        del turns[t]
        if t == inter.turn:
            log.warning(
                "turn %s of session %r alone exceeds the judge state bound (%d bytes): "
                "not kept, its next states will be dead-lettered",
                t,
                inter.session_id,
                budget,
            )


def on_next_state(
    state: JudgeState | None, ns: NextState, now_ms: int
) -> tuple[JudgeState, list[NextState]]:
    """Add a next state; return the state and the next states now ready to judge."""
    state = JudgeState() if state is None else state
    if is_session_outcome(ns):
        return state, []  # session outcomes feed the reward, they judge no single turn
    state.pending[ns.event_id] = Pending(now_ms, ns.turn)
    return state, [ns]


def take_ready(state: JudgeState, ns: NextState) -> JudgeWork | None:
    """The judge work for ``ns`` if its turn is known (and drop it from pending)."""
    turn = state.turns.get(ns.turn)
    if turn is None:
        return None
    state.pending.pop(ns.event_id, None)
    ctx = TurnContext(ns.session_id, ns.turn, turn.request, turn.answer)
    return JudgeWork(ctx, turn.event_id, ns)


def expired(state: JudgeState, now_ms: int, grace_ms: int) -> list[str]:
    """Pending next-state ids older than the grace period (to dead-letter)."""
    return [nid for nid, p in state.pending.items() if now_ms - p.since_ms > grace_ms]


async def judge_one(judge: Judge, work: JudgeWork) -> JudgeOutput:
    """Run the judge (which never raises) and build the prm_score and hint events."""
    try:
        verdict = await judge.judge(work.ctx, work.state)
    except Exception as exc:  # noqa: BLE001 - a plug-in judge must not crash the worker
        verdict = Verdict(0, [], error=f"judge raised {type(exc).__name__}: {exc}"[:500])
    else:
        # A plug-in judge is not type-checked: a score or vote outside -1, 0, 1 would make a
        # prm_score that fails its schema, so readers would dead-letter the turn's score.
        bad = [
            v
            for v in (verdict.score, *verdict.votes)
            if v is not None and (type(v) is not int or as_vote(v) is None)
        ]
        if bad:
            verdict = Verdict(0, [], error=f"judge returned {bad[0]!r}, not a vote (-1, 0, 1)")
    ns = work.state
    parents = [work.interaction_id, ns.event_id]
    # A judge whose configuration moves while it runs (a panel weighted live) names the
    # version its verdict was made under: the id must derive from what decided it.
    version = verdict.version or judge.version
    producer = Producer(component=JUDGE_COMPONENT, version=version)
    prm = PrmScore(
        event_id=derive_event_id("prm_score", parents, version),
        producer=producer,
        parents=parents,
        session_id=ns.session_id,
        turn=ns.turn,
        score=verdict.score,
        votes=verdict.votes,
        judge_id=judge.judge_id,
        judge_version=version,
        rationale=verdict.rationale,
        error=verdict.error,
        members=verdict.members,
    )
    hints = [
        Hint(
            event_id=derive_event_id("hint", parents, version, rank),
            producer=producer,
            parents=parents,
            session_id=ns.session_id,
            turn=ns.turn,
            hint=text,
            judge_id=judge.judge_id,
            rank=rank,
        )
        for rank, text in enumerate(verdict.hints)
    ]
    return JudgeOutput(prm, hints)
