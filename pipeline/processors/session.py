"""The session stage: pairing, path penalties, judging and assembly of one session, fused.

One Faust agent reads a session's turns once and does all the per-session work in one place
(``app.py`` only wires it). Before, four agents each read the same interaction (a turn was
consumed ~9 times and written ~14 times across topics and changelogs); now a turn is read once
from ``interactions`` and its derived next state once more from ``next_states``, where the
stage recognises its own output and skips it.

State: one typed :class:`SessionState` per session, one changelog value, made of the three
stage states (each bounded on its own, see :meth:`SessionStage.bounds`). Every function here is
pure apart from updating the given state in place: events in, events out. Judging itself is
async (a judge is an ``async`` callable) and stays in the agent: the stage says which next
states are ready (:attr:`Step.work`); the agent runs the judge and hands the verdicts back with
:meth:`SessionStage.on_verdict`.

Next states of a turn that has not arrived yet (another producer's next state read before its
interaction) wait in :attr:`JudgeState.pending`; the agent keeps their records in a changelogged
table of its own, so a killed worker loses none of them.

Event ids are derived from parent ids and config versions, so a redelivered input (at-least-
once) produces the same events again, which every consumer drops by id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipeline.events import Hint, Interaction, NextState, PathPenalty, PrmScore

from . import judging
from .judging import JUDGE_COMPONENT, JudgeState, JudgeWork
from .pairing import Pairer, PairingState
from .rewards import Assembler, AssemblyState, LeftOut, RecordAt
from .state_json import StateJson

# What the stage's pairing writes to next_states carries this producer component and source:
# when the agent reads it back it has already been applied.
DERIVED = Pairer.component


def is_derived(ns: NextState) -> bool:
    """A next state some pairing derived from the interactions (ours, or a replayed copy of
    the live one): the session agent derives it again itself."""
    return ns.source == "pairing" and ns.producer.component == DERIVED


@dataclass(slots=True)
class SessionState:
    """Everything the pipeline keeps of one session (one changelog value)."""

    pairing: PairingState = field(default_factory=PairingState)
    judging: JudgeState = field(default_factory=JudgeState)
    assembly: AssemblyState = field(default_factory=AssemblyState)
    touched_ms: int = 0


_JSON: StateJson[SessionState] = StateJson(SessionState)


def dump(state: SessionState) -> bytes:
    return _JSON.dump(state)


def load(raw: bytes) -> SessionState:
    """A stored state; StateUnreadable for a value another code version wrote."""
    return _JSON.load(raw)


@dataclass
class Step:
    """What one input makes the agent do: publish the derived events, judge ``work``."""

    next_states: list[NextState] = field(default_factory=list)
    penalties: list[PathPenalty] = field(default_factory=list)
    work: list[JudgeWork] = field(default_factory=list)
    # Next states of turns not seen yet: the agent keeps their records until the turn arrives.
    parked: list[NextState] = field(default_factory=list)
    # Inputs that count in no reward (a replaced vote, one over the cap, one read after the
    # session was assembled): the agent dead-letters and counts them.
    left_out: list[LeftOut] = field(default_factory=list)
    # False: the input changed nothing (the agent then writes no state either).
    applied: bool = True


@dataclass(eq=False)
class SessionStage:
    """The per-session logic. ``judge_inline``: judge here (cheap judges: rules, replies);
    otherwise a separate judge agent judges the ``next_states`` topic and the verdicts come
    back through ``prm_scores`` and ``hints`` (the LLM judge: slow, batched, concurrent)."""

    pairer: Pairer
    assembler: Assembler
    judge_inline: bool = True
    text_chars: int = judging.TEXT_CHARS
    judge_max_bytes: int = judging.STATE_BYTES

    def on_interaction(
        self, state: SessionState, inter: Interaction, now_ms: int, at: RecordAt | None = None
    ) -> Step:
        """A turn: pair it with the previous one (next state + path penalty of that one),
        remember what the judge and the assembler need of it (of its tokens, only ``at``:
        where it was read)."""
        paired = self.pairer.on_interaction(state.pairing, inter, now_ms)
        state.pairing = paired.state
        state.assembly = self.assembler.on_interaction(state.assembly, inter, keep_tokens=False,
                                                       at=at)  # fmt: skip
        if self.judge_inline:
            state.judging = judging.on_interaction(
                state.judging, inter, text_chars=self.text_chars, max_bytes=self.judge_max_bytes
            )
        return self._derived(state, paired.next_states, paired.penalties, now_ms)

    def on_idle(self, state: SessionState, now_ms: int, idle_timeout_ms: int) -> Step:
        """Close a session idle past the timeout (its ``session_end`` next state)."""
        closed = self.pairer.on_idle(state.pairing, now_ms, idle_timeout_ms)
        state.pairing = closed.state
        return self._derived(state, closed.next_states, closed.penalties, now_ms)

    def _derived(
        self,
        state: SessionState,
        next_states: list[NextState],
        penalties: list[PathPenalty],
        now_ms: int,
    ) -> Step:
        step = Step(next_states=next_states, penalties=penalties)
        for pen in penalties:
            state.assembly = self.assembler.on_penalty(state.assembly, pen)
        for ns in next_states:
            self._next_state(state, ns, now_ms, step)
        return step

    def on_next_state(self, state: SessionState, ns: NextState, now_ms: int) -> Step:
        """A next state read from the topic: from another producer (feedback, hooks, a
        quality gate) it counts; our own pairing's was applied when it was derived."""
        turn = state.assembly.turns.get(ns.turn)
        if is_derived(ns) or (turn is not None and ns.event_id in turn.next_states):
            return Step(applied=False)  # derived here, or a redelivery: applied already
        step = Step()
        if ns.kind == "gui" and not state.assembly.done \
                and self.assembler.refusal(state.assembly, ns) is None:  # fmt: skip
            pen = self.pairer.on_gui(state.pairing, ns)
            if pen is not None:  # before its verdict, so the reward always counts it
                step.penalties.append(pen)
                state.assembly = self.assembler.on_action_penalty(state.assembly, pen)
        self._next_state(state, ns, now_ms, step)
        return step

    def _next_state(self, state: SessionState, ns: NextState, now_ms: int, step: Step) -> None:
        if state.assembly.done and not is_derived(ns):
            # Its session's rewards and samples have left: it would be judged for nothing.
            step.left_out.append(LeftOut(
                "late", ns.event_id, ns.turn,
                f"next state {ns.event_id} ({ns.kind}) for turn {ns.turn} of session "
                f"{ns.session_id} arrived after the session was assembled (its rewards have "
                "left; processors.hint_wait_s holds closed sessions open)", ns,
            ))  # fmt: skip
            return
        state.assembly, left_out = self.assembler.admit(state.assembly, ns, now_ms)
        step.left_out += left_out
        if not self.judge_inline or any(x.event is ns for x in left_out):
            return
        state.judging, todo = judging.on_next_state(state.judging, ns, now_ms)
        for ready in todo:
            work = judging.take_ready(state.judging, ready)
            if work is not None:
                step.work.append(work)
            else:
                step.parked.append(ready)

    def ready_parked(self, state: SessionState, turn: int) -> list[str]:
        """Ids of parked next states whose turn is now known (the agent judges them with
        :meth:`take_parked`, from the records it kept)."""
        known = turn in state.judging.turns
        return [nid for nid, p in state.judging.pending.items() if known and p.turn == turn]

    def take_parked(self, state: SessionState, ns: NextState) -> JudgeWork | None:
        return judging.take_ready(state.judging, ns)

    def expired(self, state: SessionState, now_ms: int, grace_ms: int) -> dict[str, int]:
        """Parked next states past the grace period (id -> turn, to dead-letter), dropped from
        the state."""
        return {
            nid: state.judging.pending.pop(nid).turn
            for nid in judging.expired(state.judging, now_ms, grace_ms)
        }

    def on_verdict(
        self, state: SessionState, prm: PrmScore, hints: list[Hint], now_ms: int
    ) -> None:
        state.assembly = self.assembler.on_prm(state.assembly, prm, now_ms)
        for hint in hints:
            state.assembly = self.assembler.on_hint(state.assembly, hint)

    def on_hint(self, state: SessionState, hint: Hint) -> Literal["applied", "late"] | None:
        """A hint read from the topic: another judge's or a person's (the inline judge's
        own come back too). Returns "applied", None when it changes nothing (known already:
        the inline judge's own, read back) or "late" when its session was assembled without
        it (the caller dead-letters it)."""
        turn = state.assembly.turns.get(hint.turn)
        if turn is not None and hint.event_id in turn.hints:
            return None
        if state.assembly.done:
            own = self.judge_inline and hint.producer.component == JUDGE_COMPONENT
            return None if own else "late"
        state.assembly = self.assembler.on_hint(state.assembly, hint)
        return "applied"
