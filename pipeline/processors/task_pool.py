"""The verified-task pool (#26 item 4, ScaleCUA's VeriGen from real traffic): sessions whose
outcome was verified become tasks, once k judges have voted on them.

A *verified* outcome is a next state whose verifiable signal is positive
(:func:`~pipeline.processors.consistency.outcome_vote` is +1: a gate or test run with exit
code 0, explicit feedback with a positive score). Each one is joined to its session's main-line
interactions (all of them for a session-scoped outcome, those up to its turn for a turn-scoped
one) and becomes a candidate task: the session's first user message as the prompt, the final
answer, the checker (the gate's command line, exit code, score, source) and the provenance
(every event id, and its topic, partition and offset when read from Kafka).

Each of the k judges (``tasks.judges``, by registry name) judges the final turn against the
verifying outcome, as the workers judge a turn against its next state; the task is *accepted*
only when a strict majority votes +1 (an abstention counts against), else *rejected*, and is
published either way on ``liverl.tasks.v1`` so every decision can be audited. A judge that
reads the exit code (rules, replies) confirms the checker; one that reads the answer (llm, a
plug-in) can overrule it.

:class:`TaskPool` follows the consistency watcher's shape: at start it reads the tasks topic
(which ids were published), then interactions and next states from their beginning, builds
and publishes the tasks never published, then follows the topics' ends. The task id derives
from the session and the outcome event, so a rerun, or a crash between a send and the next
start, rewrites the same key of the compacted topic.

A session is *one* task, from its first verified outcome (issue 38: a session that passes,
fails, then passes was two tasks). Every later outcome of the session, either sign, is added
to it (``outcomes``, with the policy version of the turn it judged) and the task is published
again under its key without a new vote; a failure among them *withdraws* an accepted task
(status ``withdrawn``: kept for audit, never exported or replayed): a checker that failed
after verifying it does not keep the task verified. A failure before the first verified
outcome is the work in progress the pass fixed, and counts nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline import events
from pipeline.events import Interaction, NextState
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable

from .consistency import outcome_vote
from .forget import ChangelogHit
from .judges import Judge, TurnContext, answer_text, content_text, last_user_text
from .outcomes import GATE_RUNNER

log = logging.getLogger(__name__)
VERSION = "tasks-1"  # in every task's event id: change the join or the vote, change it
PRODUCER = events.Producer(component="task_pool", version=VERSION)
RATIONALE_CHARS = 500
CONTENT_CHARS = 2000
MAX_OUTCOMES = 50  # of a task's outcomes kept in its event, newest

At = tuple[str, int, int]  # topic, partition, offset


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


@dataclass(frozen=True)
class Turn:
    """What a task keeps of one interaction (bounded texts, never its tokens)."""

    event_id: str
    session_id: str
    turn: int
    ts_ms: int
    prompt: str  # the first user message of its messages
    request: str  # the last user message
    answer: str
    messages: tuple[tuple[str, str], ...]
    at: At | None = None
    policy_id: str | None = None
    weight_version: int | None = None

    @classmethod
    def of(cls, inter: Interaction, at: At | None = None, chars: int = 8000) -> Turn:
        msgs: list[tuple[str, str]] = []
        left = chars
        for m in inter.messages:
            if left <= 0:
                break
            text = _cut(content_text(m.get("content")), left)
            left -= len(text)
            msgs.append((str(m.get("role") or ""), text))
        first = next(
            (content_text(m.get("content")) for m in inter.messages if m.get("role") == "user"), ""
        )
        return cls(
            inter.event_id,
            inter.session_id,
            inter.turn,
            inter.ts_ms,
            _cut(first, chars),
            _cut(last_user_text(inter.messages), chars),
            _cut(answer_text(inter), chars),
            tuple(msgs),
            at,
            inter.policy_id,
            inter.weight_version,
        )


@dataclass(frozen=True)
class Outcome:
    state: NextState
    at: At | None = None


@dataclass(frozen=True)
class Candidate:
    """A verified outcome joined to the turns it verified (in turn order, at least one), and
    the session's outcomes from it on (``record``, as kept in the task's ``outcomes``)."""

    outcome: Outcome
    turns: tuple[Turn, ...]
    record: tuple[dict[str, Any], ...] = ()

    @property
    def withdrawn(self) -> bool:
        """An outcome after the verifying one failed."""
        return any(r["vote"] == -1 for r in self.record)

    @property
    def session_id(self) -> str:
        return self.outcome.state.session_id

    @property
    def task_id(self) -> str:
        return task_id(self.session_id, self.outcome.state.event_id)


def task_id(session_id: str, outcome_id: str) -> str:
    """``task-`` and 16 hex digits of the session and the outcome event: stable across reruns."""
    digest = hashlib.sha256(f"{VERSION}\0{session_id}\0{outcome_id}".encode()).hexdigest()
    return f"task-{digest[:16]}"


def verified(state: NextState) -> bool:
    """Whether a next state verifies its session (or turn) as solved."""
    return outcome_vote(state) == 1


def majority(votes: Sequence[int]) -> bool:
    """A strict majority of all the votes is +1 (abstentions and errors count against)."""
    return 2 * sum(1 for v in votes if v == 1) > len(votes)


class TaskJoin:
    """Joins outcomes to their sessions' interactions, in either order (they are different
    topics). A session's first verified outcome becomes its candidate once the session has a
    turn; each later outcome of the session (either sign) returns the candidate again with
    the outcome added to its ``record``."""

    def __init__(self, session_prefix: str = "", chars: int = 8000) -> None:
        self.session_prefix = session_prefix
        self.chars = chars
        self.turns: dict[str, dict[str, Turn]] = {}
        self.waiting: dict[str, dict[str, Outcome]] = {}
        self.joined: set[str] = set()  # outcome event ids
        self.tasks: dict[str, Candidate] = {}  # session id -> its candidate

    def _mine(self, session_id: str) -> bool:
        return session_id.startswith(self.session_prefix)

    def interaction(self, inter: Interaction, at: At | None = None) -> list[Candidate]:
        if inter.turn_type != "main" or not self._mine(inter.session_id):
            return []
        self.turns.setdefault(inter.session_id, {}).setdefault(
            inter.event_id, Turn.of(inter, at, self.chars)
        )
        waiting = self.waiting.pop(inter.session_id, {})
        out: dict[str, Candidate] = {}
        for o in sorted(waiting.values(), key=lambda o: (o.state.ts_ms, o.state.event_id)):
            for c in self._take(o):
                out[c.task_id] = c
        left = {i: o for i, o in waiting.items() if i not in self.joined}
        if left:
            self.waiting[inter.session_id] = left
        return list(out.values())

    def outcome(self, state: NextState, at: At | None = None) -> list[Candidate]:
        if (
            outcome_vote(state) is None
            or not self._mine(state.session_id)
            or state.event_id in self.joined
        ):
            return []
        o = Outcome(state, at)
        out = self._take(o)
        if not out and state.event_id not in self.joined:
            self.waiting.setdefault(state.session_id, {})[state.event_id] = o
        return out

    def _take(self, o: Outcome) -> list[Candidate]:
        """``o`` added to its session's candidate, or made it; [] when it must wait for a
        turn (or is a failure before any verified outcome: dropped)."""
        s = o.state
        c = self.tasks.get(s.session_id)
        if c is not None:
            self.joined.add(s.event_id)
            if (s.ts_ms, s.event_id) < (c.outcome.state.ts_ms, c.outcome.state.event_id):
                return []  # before the verifying one: work in progress
            c = dataclasses.replace(c, record=(*c.record, self._record(s)))
            self.tasks[s.session_id] = c
            return [c]
        if not verified(s):
            if self.turns.get(s.session_id):
                self.joined.add(s.event_id)  # a failure before any pass: nothing to mark
            return []
        c = self._join(o)
        if c is None:
            return []
        c = dataclasses.replace(c, record=(self._record(s),))
        self.tasks[s.session_id] = c
        return [c]

    def _record(self, s: NextState) -> dict[str, Any]:
        """An outcome as a task keeps it: with the policy version of the turn it judged (the
        session's last known turn for a session outcome)."""
        turns = sorted(
            self.turns.get(s.session_id, {}).values(), key=lambda t: (t.turn, t.ts_ms, t.event_id)
        )
        judged = [t for t in turns if s.scope == "session" or t.turn <= s.turn]
        t = judged[-1] if judged else None
        return {
            "outcome_id": s.event_id,
            "ts_ms": s.ts_ms,
            "turn": None if s.scope == "session" else s.turn,
            "vote": outcome_vote(s),
            "policy_id": t.policy_id if t else None,
            "weight_version": t.weight_version if t else None,
        }

    def _join(self, o: Outcome) -> Candidate | None:
        s = o.state
        turns = [
            t
            for t in self.turns.get(s.session_id, {}).values()
            if s.scope == "session" or t.turn <= s.turn
        ]
        if not turns:
            return None
        self.joined.add(s.event_id)
        return Candidate(o, tuple(sorted(turns, key=lambda t: (t.turn, t.ts_ms, t.event_id))))

    def feed(
        self,
        interactions: Iterable[tuple[Interaction, At | None]],
        outcomes: Iterable[tuple[NextState, At | None]],
    ) -> list[Candidate]:
        """A batch read: every interaction first, then the outcomes in order; each task once,
        as it stands after them all."""
        for inter, at in interactions:
            self.interaction(inter, at)
        out: dict[str, Candidate] = {}
        for state, at in outcomes:
            for c in self.outcome(state, at):
                out[c.task_id] = c
        return list(out.values())


# ---- the vote ------------------------------------------------------------------------------


def ran_by_liverl(state: NextState) -> bool:
    """Whether liverl itself ran the outcome's command: ``liverl record-outcome -- CMD`` and
    ``liverl gates run`` (outcomes.gate_event) write producer ``record-outcome``; every
    gateway source writes producer ``gateway``, so a command a client posted never counts."""
    return state.producer.component == GATE_RUNNER and state.kind in ("test_result", "feedback")


def checker_of(state: NextState, chars: int = CONTENT_CHARS) -> dict[str, Any]:
    """What verified the session: a gate's command liverl ran (``command``, the only kind
    ``liverl tasks check`` runs again), a command a client reported having run (``reported``:
    a terminal next state posted to the gateway; evidence, never run), a recorded test result,
    or feedback."""
    command = state.detail.get("command") if isinstance(state.detail, dict) else None
    command = command if isinstance(command, str) and command else None
    kind = (
        "command"
        if command and ran_by_liverl(state)
        else "reported"
        if command
        else "feedback"
        if state.kind == "feedback"
        else "test_result"
    )
    doc: dict[str, Any] = {
        "kind": kind,
        "command": command if kind == "command" else None,
        "exit_code": state.exit_code,
        "score": state.score,
        "source": state.source,
        "content": _cut(state.content, chars),
        "producer": state.producer.component,
    }
    if kind == "reported":
        doc["reported_command"] = command
    workspace = state.detail.get("workspace") if isinstance(state.detail, dict) else None
    if kind == "command" and isinstance(workspace, dict) and workspace.get("dir"):
        doc["workspace"] = {"dir": str(workspace["dir"]), "commit": workspace.get("commit")}
    return doc


async def _votes(
    judges: Sequence[tuple[str, Judge]], ctx: TurnContext, state: NextState
) -> list[dict[str, Any]]:
    async def one(name: str, j: Judge) -> dict[str, Any]:
        try:
            v = await j.judge(ctx, state)
            vote, why = int(v.score), v.rationale or (v.error or "")
        except Exception as exc:  # noqa: BLE001 - a judge never blocks the pool: it abstains
            vote, why = 0, f"error: {exc}"
        return {
            "judge_id": name,
            "judge_version": str(j.version),
            "vote": vote,
            "rationale": _cut(why, RATIONALE_CHARS),
        }

    return list(await asyncio.gather(*(one(n, j) for n, j in judges)))


def decide(
    c: Candidate,
    judges: Sequence[tuple[str, Judge]],
    *,
    chars: int = 8000,
    loop: asyncio.AbstractEventLoop | None = None,
) -> events.VerifiedTask:
    """The task of a candidate with its judges' votes: accepted on a strict majority of +1.
    ``loop``: the one to run the judges on (a judge may hold a client bound to its loop)."""
    final = c.turns[-1]
    ctx = TurnContext(c.session_id, final.turn, final.request, final.answer)
    vote = _votes(judges, ctx, c.outcome.state)
    votes = loop.run_until_complete(vote) if loop is not None else asyncio.run(vote)
    first = c.turns[0]
    s = c.outcome.state
    parents = _parents(c)
    spec = ";".join(f"{n}={j.version}" for n, j in judges)

    def coords(at: At | None) -> dict[str, Any]:
        return (
            {"topic": at[0], "partition": at[1], "offset": at[2]}
            if at
            else {"topic": None, "partition": None, "offset": None}
        )

    return events.VerifiedTask(
        event_id=events.derive_event_id("verified_task", parents, VERSION, spec),
        producer=PRODUCER,
        parents=parents,
        task_id=c.task_id,
        status=_status(c, majority([v["vote"] for v in votes])),
        k=len(votes),
        prompt=first.prompt,
        answer=_cut(final.answer, chars),
        messages=[{"role": r, "content": t} for r, t in first.messages],
        checker=checker_of(s),
        provenance={
            "session_id": c.session_id,
            "outcome_id": s.event_id,
            "outcome_at": None
            if c.outcome.at is None
            else {
                "topic": c.outcome.at[0],
                "partition": c.outcome.at[1],
                "offset": c.outcome.at[2],
            },
            "interactions": [
                {"event_id": t.event_id, "turn": t.turn, **coords(t.at)} for t in c.turns
            ],
        },
        votes=votes,
        outcomes=list(c.record[-MAX_OUTCOMES:]),
    )


def _parents(c: Candidate) -> list[str]:
    """The turns, the verifying outcome, then the later outcomes (none: as before they were
    kept, so a task without any keeps its event id)."""
    later = [r["outcome_id"] for r in c.record if r["outcome_id"] != c.outcome.state.event_id]
    return [*(t.event_id for t in c.turns), c.outcome.state.event_id, *later]


def _status(c: Candidate, accepted: bool) -> events.TaskStatus:
    if not accepted:
        return "rejected"
    return "withdrawn" if c.withdrawn else "accepted"


def revise(task: events.VerifiedTask, c: Candidate) -> events.VerifiedTask:
    """The task published before, with the session's outcomes since: its votes as they were
    (no judge runs again), withdrawn once a later outcome failed."""
    parents = _parents(c)
    if parents == task.parents:
        return task  # nothing since: the record as published
    spec = task.event_id  # derived from the first decision, judges included
    accepted = task.status != "rejected"
    return dataclasses.replace(
        task,
        event_id=events.derive_event_id("verified_task", parents, VERSION, spec),
        ts_ms=events.now_ms(),
        parents=parents,
        status=_status(c, accepted),
        outcomes=list(c.record[-MAX_OUTCOMES:]),
    )


def build_judges(
    names_: Sequence[str],
    options: dict[str, dict[str, Any]] | None = None,
    plugins: Sequence[str] = (),
) -> list[tuple[str, Judge]]:
    """The judges by registry name (plug-in modules imported first)."""
    from pipeline.registry import load_plugins

    from .judges import make_judge

    load_plugins(list(plugins), "processors")
    return [(n, make_judge(n, (options or {}).get(n))) for n in names_]


# ---- reading and following -----------------------------------------------------------------


def _at(msg: Any) -> At:
    return (str(msg.topic()), int(msg.partition()), int(msg.offset()))


def _decode(raw: bytes | None) -> events.Event | None:
    try:
        return events.decode(raw or b"")
    except Exception:  # noqa: BLE001 - another component's bad record is theirs to report
        return None


def read_tasks(
    settings: Connectable, namespace: str | None = None, idle_timeout_s: float = 30.0
) -> dict[str, events.VerifiedTask]:
    """The pool as it stands: per task id its latest record (tombstones remove it)."""
    from pipeline.kafka.reader import read_to_end

    found: dict[str, events.VerifiedTask] = {}

    def collect(msg: Any) -> None:
        key = (msg.key() or b"").decode("utf-8", "replace")
        if msg.value() is None:
            found.pop(key, None)
            return
        ev = _decode(msg.value())
        if isinstance(ev, events.VerifiedTask):
            found[ev.task_id] = ev

    read_to_end(
        settings,
        [names.resolve(names.TASKS, namespace)],
        collect,
        group_prefix="liverl-tasks-read",
        idle_timeout_s=idle_timeout_s,
    )
    return found


@dataclass
class PoolStats:
    accepted: int = 0
    rejected: int = 0
    revised: int = 0  # published again with later outcomes (withdrawn ones included)
    withdrawn: int = 0
    skipped: int = 0  # built again, but already published

    @property
    def sent(self) -> int:
        return self.accepted + self.rejected + self.revised


@dataclass
class TaskPool:
    """One process's pool. ``run(stop)`` catches up, then follows until ``stop`` is set
    (``once``: returns after the catch-up)."""

    settings: Connectable
    judges: list[tuple[str, Judge]]
    namespace: str | None = None
    session_prefix: str = ""
    chars: int = 8000
    on_task: Callable[[events.VerifiedTask], None] | None = None
    stats: PoolStats = field(default_factory=PoolStats)

    def __post_init__(self) -> None:
        if len(self.judges) % 2 == 0:
            raise ValueError(f"k = {len(self.judges)} judges: k must be odd")
        self.join = TaskJoin(self.session_prefix, self.chars)
        self.inputs = [
            names.resolve(names.INTERACTIONS, self.namespace),
            names.resolve(names.NEXT_STATES, self.namespace),
        ]
        self.output = names.resolve(names.TASKS, self.namespace)
        self.published: dict[str, events.VerifiedTask] = {}  # task id -> its latest record
        self._producer: Any = None
        self._loop = asyncio.new_event_loop()

    def handle(self, msg: Any) -> list[Candidate]:
        ev = _decode(msg.value())
        if isinstance(ev, Interaction):
            return self.join.interaction(ev, _at(msg))
        if isinstance(ev, NextState):
            return self.join.outcome(ev, _at(msg))
        return []

    def _ends(self) -> dict[tuple[str, int], int]:
        """The inputs' ends (the output must exist too: tasks are published there)."""
        from pipeline.kafka.reader import end_offsets

        hint = "liverl topics apply" + (f" --namespace {self.namespace}" if self.namespace else "")
        ends = end_offsets(
            self.settings, [*self.inputs, self.output], group_prefix="liverl-tasks-ends", hint=hint
        )
        return {(t, p): o for (t, p), o in ends.items() if t != self.output}

    def catch_up(self) -> dict[tuple[str, int], int]:
        """Rebuild the join from history; publish what was never published. Returns the
        offsets to follow from."""
        from pipeline.kafka.reader import read_to_end

        ends = self._ends()
        self.published.update(read_tasks(self.settings, self.namespace))
        inters: list[tuple[Interaction, At | None]] = []
        outcomes: list[tuple[NextState, At | None]] = []

        def collect(msg: Any) -> None:
            if (msg.topic(), msg.partition()) in ends and msg.offset() >= ends[
                (msg.topic(), msg.partition())
            ]:
                return  # past the ends captured: the follower reads it
            ev = _decode(msg.value())
            if isinstance(ev, Interaction):
                inters.append((ev, _at(msg)))
            elif isinstance(ev, NextState) and outcome_vote(ev) is not None:
                outcomes.append((ev, _at(msg)))

        read_to_end(self.settings, self.inputs, collect, group_prefix="liverl-tasks-history")
        outcomes.sort(key=lambda o: (o[0].ts_ms, o[0].event_id))
        self._publish(self.join.feed(inters, outcomes))
        return ends

    def run(self, stop: threading.Event | None = None, *, once: bool = False) -> None:
        from pipeline.kafka.reader import follow

        ends = self.catch_up()
        if once:
            self.close()
            return

        def batch(msgs: list[Any]) -> None:
            self._publish([c for msg in msgs for c in self.handle(msg)])

        try:
            follow(
                self.settings,
                ends,
                batch,
                stop or threading.Event(),
                group_prefix="liverl-tasks-follow",
                label="task pool reader",
            )
        finally:
            self.close()

    def _publish(self, found: list[Candidate]) -> None:
        """Decide new tasks; revise known ones with their later outcomes (no new vote). A
        record already published (same event id) is not sent again."""
        sent = False
        for c in {c.task_id: c for c in found}.values():  # the newest of each task
            old = self.published.get(c.task_id)
            task = (
                decide(c, self.judges, chars=self.chars, loop=self._loop)
                if old is None
                else revise(old, c)
            )
            if old is not None and task.event_id == old.event_id:
                self.stats.skipped += 1
                continue
            if self._producer is None:
                from pipeline.kafka import EventProducer

                self._producer = EventProducer(self.settings, client_id="liverl-tasks")
            self._producer.send(self.output, task, key=task.task_id)
            sent = True
            self.published[task.task_id] = task
            if old is not None:
                self.stats.revised += 1
                self.stats.withdrawn += task.status == "withdrawn" != old.status
            elif task.status == "rejected":
                self.stats.rejected += 1
            else:
                self.stats.accepted += 1
                self.stats.withdrawn += task.status == "withdrawn"
            if self.on_task is not None:
                self.on_task(task)
        if sent:
            self._producer.flush()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush()
        for _, j in self.judges:
            aclose = getattr(j, "aclose", None)
            if aclose is not None and not self._loop.is_closed():
                self._loop.run_until_complete(aclose())
        if not self._loop.is_closed():
            self._loop.close()


# ---- forgetting ------------------------------------------------------------------------------


def forget_survey(
    connection: Connectable, sessions: list[str], present: set[str]
) -> list[ChangelogHit]:
    """``liverl forget``'s part: per tasks topic (live and every replay namespace's copy), the
    keys whose latest task came from one of ``sessions`` (a task holds the session's prompt
    and answer). The topic is compacted, so a tombstone per key (``processors.forget.erase``)
    removes them."""
    from pipeline.kafka.reader import read_to_end

    from .forget import GROUP_PREFIX

    topics = sorted(t for t in present if names.live(t, names.namespace_of(t)) == names.TASKS)
    wanted = set(sessions)
    latest: dict[tuple[str, int, bytes], bool] = {}  # key -> its latest task is the sessions'

    def handle(m: Any) -> None:
        key = m.key()
        if key is None:
            return
        ev = None if m.value() is None else _decode(m.value())
        mine = isinstance(ev, events.VerifiedTask) and ev.provenance.get("session_id") in wanted
        latest[(m.topic(), m.partition(), key)] = mine

    read_to_end(connection, topics, handle, group_prefix=GROUP_PREFIX)
    hits: dict[str, ChangelogHit] = {}
    for (topic, partition, key), mine in sorted(latest.items()):
        if mine:
            hits.setdefault(topic, ChangelogHit(topic, [])).keys.append((partition, key))
    return list(hits.values())
