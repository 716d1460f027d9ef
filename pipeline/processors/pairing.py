"""Next-state pairing: when turn t+1 of a session arrives, what it adds after turn t's prompt
and answer is turn t's next state. Tool results that report a shell exit code make it a
``terminal`` next state with that code and the output's tails (see ``terminal.py``), so the
judges see a verifiable pass/fail instead of raw tool text. Also evaluates the turn's path
penalties, because pairing is where a turn's tool calls meet their results, in session order.

:class:`Pairer` is pure: a session's state is a :class:`PairingState` (typed, so the session
table's JSON, `state_json.py`, round-trips it exactly), and every call returns the events to emit
with the state. A call may update the state it is given in place and returns it, so callers
always go on with the returned object. Event ids are derived from the parent interaction ids
and the config version, so a replay emits the same ids.

Turn order within a session is (``ts_ms``, ``turn``, ``event_id``) of the interactions, not the
gateway's turn number alone: gateway replicas without sticky sessions stamp each turn with a
per-session monotonic timestamp, and the turn number only breaks ties between events of the
same millisecond (producers other than the gateway). An interaction at or before the session's
last one in that order is a redelivery (or arrived after a later turn) and pairs nothing, so
derived events stay exactly-once.

The state is a changelog value, so it is bounded whatever the traffic (``text_chars``,
``max_bytes``): a tool call is kept as its identity (name and canonical arguments, replaced by
a prefix and their sha256 when longer than ``text_chars``, so "the same call" still compares
exactly) and its command (head and tail, ``text_chars`` in all); a turn keeps the calls that fit
in half of ``max_bytes``, and the rules' history drops its oldest failure counts, penalised
intents and once-per-turn marks while it would take more than the other half (what the path
potential is computed from, per-rule debts and progress facts, is a few entries per rule and is
never dropped, so the session's shaping still telescopes).
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from pipeline.events import Interaction, NextState, PathPenalty, Producer, derive_event_id
from pipeline.events.types import NextStateKind

from .judges import content_text
from .penalties import PathHistory, PathResult, RuleSet, ToolCall
from .terminal import combined_exit_code, parse_tool_message

log = logging.getLogger(__name__)
TEXT_CHARS = 4_096  # defaults of ProcessorSettings.state_text_chars / state_max_bytes
STATE_BYTES = 1 << 20
_ID_CHARS = 256  # tool call ids longer than this are replaced by a digest
SEEN = 16  # recent interaction ids kept per session (only to name late arrivals in the log)


@dataclass(slots=True)
class PrevTurn:
    """The session's last turn, as much of it as pairing the next turn needs."""

    event_id: str
    turn: int
    ts_ms: int
    messages_len: int  # its prompt's length: what the next turn adds comes after its answer
    trainable: bool
    tool_calls: list[list[str]]  # stored form, see keep_call: what its penalty evaluates


@dataclass(slots=True)
class PairingState:
    """One session's pairing state; ``PairingState()`` is a session not seen yet."""

    session_id: str = ""
    last_seen_ms: int | None = None  # processing time of its last turn, for the idle timeout
    closed: bool = False
    seen: list[str] = field(default_factory=list)  # the last SEEN turns' ids, oldest first
    prev: PrevTurn | None = None
    history: dict[str, Any] | None = None  # PathHistory.to_json(), bounded: see the module doc


@dataclass
class PairOutput:
    """Events to emit for one input, and the session's new state."""

    state: PairingState
    next_states: list[NextState] = field(default_factory=list)
    penalties: list[PathPenalty] = field(default_factory=list)


def tool_calls_of(inter: Interaction) -> list[ToolCall]:
    """The turn's tool calls: the interaction's ``tool_calls`` (OpenAI format)."""
    out = []
    for i, c in enumerate(inter.tool_calls):
        fn = c.get("function") or {}
        args = fn.get("arguments") or ""
        out.append(ToolCall(str(c.get("id") or i), str(fn.get("name", "?")), args))
    return out


@dataclass(frozen=True)
class KeptCall(ToolCall):
    """A tool call as the pairing state keeps it: its identity and command, already bounded
    (the rules use nothing else of the arguments)."""

    kept_key: str = ""
    kept_command: str = ""

    @property
    def key(self) -> str:
        return self.kept_key

    @property
    def command(self) -> str:
        return self.kept_command


def bounded(text: str, chars: int) -> str:
    """``text``, or its head and tail with a marker, ``chars`` characters in all."""
    if len(text) <= chars:
        return text
    half = (chars - 3) // 2
    return text[:half] + "\n…\n" + text[len(text) - (chars - 3 - half) :]


def bounded_id(text: str, chars: int) -> str:
    """``text``, or a prefix and the sha256 of the whole: still equal exactly when equal."""
    if len(text) <= chars:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return text[: max(0, chars - 72)] + "…sha256:" + digest


def keep_call(call: ToolCall, chars: int) -> list[str]:
    """The stored form of a call: [id, name, identity, command]."""
    return [
        bounded_id(call.call_id, _ID_CHARS),
        bounded_id(call.name, _ID_CHARS),
        bounded_id(call.key, chars),
        bounded(call.command, chars),
    ]


def kept_call(stored: list[str], result: str | None) -> KeptCall:
    """A stored call (see :func:`keep_call`) back as a :class:`ToolCall`."""
    cid, name, key, command = stored
    return KeptCall(cid, name, "", result, kept_key=key, kept_command=command)


def added_messages(prev_len: int, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages turn t+1 adds after turn t's prompt (``prev_len`` messages) and answer.

    Normally the answer sits at index ``prev_len``; when the harness rewrote history (context
    compaction) we fall back to everything after the last assistant message.
    """
    if len(messages) > prev_len and messages[prev_len].get("role") == "assistant":
        return messages[prev_len + 1 :]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    return messages[last + 1 :]


REPEAT_RATIO = 0.85  # difflib similarity above which a reply is the question asked again
REPEAT_CHARS = 1000  # of each text compared: the check stays cheap on long messages
_NON_WORD = re.compile(r"[^a-z0-9]+")


def last_user_text(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return content_text(m.get("content"))
    return ""


def repeats_question(question: str, reply: str) -> bool:
    """Whether ``reply`` asks ``question`` again: nearly the same words (difflib ratio >=
    REPEAT_RATIO), or the whole question inside the reply ("I asked: how do I boil an
    egg?"). A question of fewer than three words never counts ("why?" is not a repeat)."""
    q = _NON_WORD.sub(" ", question[:REPEAT_CHARS].lower()).strip()
    r = _NON_WORD.sub(" ", reply[:REPEAT_CHARS].lower()).strip()
    if len(q.split()) < 3 or not r:
        return False
    if f" {q} " in f" {r} ":
        return True
    return difflib.SequenceMatcher(None, q, r, autojunk=False).ratio() >= REPEAT_RATIO


def comes_after(inter: Interaction, prev: PrevTurn) -> bool:
    """Whether ``inter`` follows the session's last paired turn (see the module doc)."""
    return (inter.ts_ms, inter.turn, inter.event_id) > (prev.ts_ms, prev.turn, prev.event_id)


class Pairer:
    """Session state machine for pairing and path penalties."""

    component = "next_state"

    def __init__(
        self,
        rules: RuleSet,
        version: str = "pairing-1",
        *,
        text_chars: int = TEXT_CHARS,
        max_bytes: int = STATE_BYTES,
    ) -> None:
        self.rules = rules
        self.version = version
        self.text_chars = text_chars
        self.max_bytes = max_bytes
        self.producer = Producer(component=self.component, version=version)
        self.penalty_producer = Producer(component="penalties", version=rules.version)

    def on_interaction(
        self, state: PairingState | None, inter: Interaction, now_ms: int | None = None
    ) -> PairOutput:
        """Pair the previous trainable turn with this one; close on ``session_done``.

        ``now_ms`` is processing time for the idle timeout (default: the event's time). The
        worker passes the wall clock, so a replay of old traffic is not all idle at once.
        """
        state = PairingState() if state is None else state
        out = PairOutput(state)
        if inter.turn_type == "side":
            return out  # served, never recorded, never pairs
        prev = state.prev
        if prev is not None and not comes_after(inter, prev):
            if inter.event_id != prev.event_id and inter.event_id not in state.seen:
                log.warning(
                    "session %r: turn %d (event %s) reached pairing after a later turn of the "
                    "session; not paired (its replica recorded it late)",
                    inter.session_id,
                    inter.turn,
                    inter.event_id,
                )
            return out  # duplicate or out-of-order redelivery: already paired
        state.session_id = inter.session_id
        state.last_seen_ms = inter.ts_ms if now_ms is None else now_ms
        if prev is not None and prev.trainable and not state.closed:
            added = added_messages(prev.messages_len, inter.messages)
            out.next_states.append(self._paired(prev, inter, added))
            out.penalties.append(self._penalty(state, prev, added))
        state.closed = False
        # The last few turns' ids: a redelivery is told apart from a turn that arrived late.
        state.seen = [*state.seen[-(SEEN - 1) :], inter.event_id]
        state.prev = PrevTurn(
            event_id=inter.event_id,
            turn=inter.turn,
            ts_ms=inter.ts_ms,
            messages_len=len(inter.messages),
            trainable=inter.train,
            tool_calls=self._keep_calls(inter),
        )
        if inter.session_done:
            self._close(state, out, inter.ts_ms, "session_done")
        return out

    def _keep_calls(self, inter: Interaction) -> list[list[str]]:
        """The turn's calls in stored form, as many as fit in half the state bound."""
        kept: list[list[str]] = []
        room = self.max_bytes // 2
        calls = tool_calls_of(inter)
        for call in calls:
            stored = keep_call(call, self.text_chars)
            room -= len(orjson.dumps(stored)) + 1
            if room < 0:
                log.warning(
                    "turn %d of session %r: %d of its %d tool calls exceed the pairing state "
                    "bound and are left out of its path penalty",
                    inter.turn,
                    inter.session_id,
                    len(calls) - len(kept),
                    len(calls),
                )
                break
            kept.append(stored)
        return kept

    def on_idle(self, state: PairingState, now_ms: int, idle_timeout_ms: int) -> PairOutput:
        """Close a session idle past the timeout (emits the session_end next state)."""
        out = PairOutput(state)
        last = now_ms if state.last_seen_ms is None else state.last_seen_ms
        if not state.closed and now_ms - last > idle_timeout_ms:
            self._close(state, out, now_ms, "idle_timeout")
        return out

    def _close(self, state: PairingState, out: PairOutput, ts_ms: int, reason: str) -> None:
        state.closed = True
        prev = state.prev
        if prev is None or not prev.trainable:
            return
        parents = [prev.event_id]
        out.next_states.append(
            NextState(
                event_id=derive_event_id("next_state", parents, self.version, "session_end"),
                ts_ms=ts_ms,
                producer=self.producer,
                parents=parents,
                session_id=state.session_id,
                turn=prev.turn,
                kind="session_end",
                content="",
                source="pairing",
                detail={"reason": reason},
            )
        )
        out.penalties.append(self._penalty(state, prev, []))

    def _paired(self, prev: PrevTurn, inter: Interaction, added: list[dict[str, Any]]) -> NextState:
        roles = [m.get("role") for m in added]
        kind: NextStateKind = "user_reply" if "user" in roles or not roles else "tool_result"
        role = "user" if "user" in roles else (roles[0] if roles else None)
        detail: dict[str, Any] = {"messages": added}
        if kind == "user_reply" and repeats_question(
            last_user_text(inter.messages[: prev.messages_len]),
            last_user_text(added),
        ):
            # The user asking again is a verifiable outcome: the answer did not answer
            # (processors/consistency.py reads it as -1 for the judges' consistency).
            detail["repeats_question"] = True
        exit_code = None
        if kind == "tool_result":
            commands = {c[0]: c[3] for c in prev.tool_calls}  # stored id -> command
            shells = [
                replace(r, command=commands.get(bounded_id(str(m.get("tool_call_id")), _ID_CHARS)))
                for m in added
                if (r := parse_tool_message(m)) is not None
            ]
            if shells:
                # Terminal even when nothing counts (read-only commands, exit 124/126/127):
                # the results stay on record, the exit code is None (no outcome).
                exit_code = combined_exit_code(shells)
                kind = "terminal"
                detail["terminal"] = [r.to_json() for r in shells]
        parents = [prev.event_id, inter.event_id]
        return NextState(
            event_id=derive_event_id("next_state", parents, self.version, kind),
            ts_ms=inter.ts_ms,
            producer=self.producer,
            parents=parents,
            session_id=inter.session_id,
            turn=prev.turn,
            kind=kind,
            role=role,
            content="\n".join(content_text(m.get("content")) for m in added),
            exit_code=exit_code,
            source="pairing",
            detail=detail,
        )

    def _penalty(
        self, state: PairingState, prev: PrevTurn, added: list[dict[str, Any]]
    ) -> PathPenalty:
        results = {
            bounded_id(str(m.get("tool_call_id")), _ID_CHARS): content_text(m.get("content"))
            for m in added
            if m.get("role") == "tool"
        }
        calls = [kept_call(c, results.get(bounded_id(c[0], _ID_CHARS))) for c in prev.tool_calls]
        history = PathHistory.from_json(state.history)
        result = self.rules.evaluate(prev.turn, calls, history)
        state.history = self._bounded_history(history)
        return self._penalty_event(prev.event_id, state.session_id, prev.turn, result)

    def on_gui(self, state: PairingState, ns: NextState) -> PathPenalty | None:
        """The path penalty of a ``gui`` next state's action (the repeated no-op rule, which
        reads the session's GUI actions in order), or None when no rule fired. It is the
        action's own, beside the turn's penalty that pairing writes when the next turn comes."""
        gui = ns.detail.get("gui")
        if not isinstance(gui, dict) or not isinstance(gui.get("action_key"), str):
            return None
        no_op = None if gui.get("first") else bool(gui.get("no_op"))
        history = PathHistory.from_json(state.history)
        key = bounded_id(gui["action_key"], self.text_chars)
        result = self.rules.evaluate_gui(ns.turn, key, no_op, history)
        state.history = self._bounded_history(history)
        if not result.hits:
            return None
        return self._penalty_event(ns.event_id, ns.session_id, ns.turn, result)

    def _penalty_event(
        self, parent: str, session_id: str, turn: int, result: PathResult
    ) -> PathPenalty:
        """A path_penalty derived from ``parent`` (a turn, or a gui next state)."""
        parents = [parent]
        return PathPenalty(
            event_id=derive_event_id("path_penalty", parents, self.rules.version),
            producer=self.penalty_producer,
            parents=parents,
            session_id=session_id,
            turn=turn,
            rule_ids=result.rule_ids,
            penalty=result.phi,
            compliance_bonus=result.compliance_bonus,
            beta=self.rules.beta,
            hits=result.hits,
        )

    def _bounded_history(self, history: PathHistory) -> dict[str, Any]:
        """The history as JSON within half the state bound: the oldest failure counts go
        first, then the oldest penalised intents, then the oldest once-per-turn marks (each is
        at most one call's bounded text, and their lists are already capped in number by the
        rules). The potential's inputs (debts, progress facts) stay."""
        doc = history.to_json()
        room = self.max_bytes // 2
        failures = list(doc["failures"].items())
        size = len(orjson.dumps(doc))
        while size > room:
            items = next((x for x in (failures, doc["penalised"], doc["credited"]) if x), None)
            if items is None:
                break
            size -= len(orjson.dumps(items.pop(0))) + 1  # an estimate: checked when it fits
            if size <= room:
                doc["failures"] = dict(failures)
                size = len(orjson.dumps(doc))
        doc["failures"] = dict(failures)
        return doc
