"""The session agent: pairing, path penalties, judging and assembly of a session in one place.

It reads interactions, next states and hints (and, with a judge that is not inline, the judge
agent's verdicts) keyed by session id, keeps one typed state per session (`session.py`, the
``sessions`` table) and publishes what the stages derive: next states, path penalties, PRM
scores, hints, rewards and samples. A turn is read once; the next state it derives is read
back once and skipped. A session with a ``group_id`` goes to the group agent instead of the
samples topic. Its timers close idle sessions, dead-letter next states whose turn never came,
assemble sessions whose grace is over and drop state untouched for ``retain_s``.

Token payloads (ids, log-probs: nearly all of an interaction's bytes) are never written: the
session state keeps where the interaction lies and the worker holds its tokens in memory,
reading the interaction back after a restart (`token_store.py`). A next state that arrives
before its interaction waits, as the record itself, in ``parked``, which is changelogged: its
offset is committed already, so SIGKILL loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import faust
import orjson
from faust.types import TopicT

from pipeline import events
from pipeline.events import Interaction
from pipeline.kafka import names

from . import judging, runtime
from . import session as session_mod
from .judges import Judge
from .key_locks import KeyLocks
from .records import (
    PARKED,
    SESSIONS,
    TOKENS,
    park,
    parked_key,
    parked_next_state,
    touched,
)
from .rewards import Assembler, RecordAt, unmatched_hints
from .runtime import Runtime
from .session import SessionStage, SessionState, Step, is_derived
from .token_store import Fetch, InteractionReader, TokenStore

log = logging.getLogger(__name__)


class SessionAgent:
    """The agent body and its timers over three tables (see the module docstring)."""

    def __init__(
        self,
        rt: Runtime,
        stage: SessionStage,
        assembler: Assembler,
        judge: Judge,
        group_topic: TopicT,
        fetch: Fetch | None = None,
    ) -> None:
        """``fetch`` reads interactions back by their coordinates (default: from the worker's
        broker, :class:`~.token_store.InteractionReader`)."""
        self.rt, self.stage, self.assembler, self.judge = rt, stage, assembler, judge
        self.group_topic = group_topic
        self.sessions = rt.table(SESSIONS)  # session id -> SessionState (session.py)
        # session\0turn -> token payload, written by workers before token_store.py: read only
        self.tokens = rt.session_table(TOKENS)
        self.reader = InteractionReader(rt.kafka) if fetch is None else None
        self.payloads = TokenStore(self.tokens, fetch or self.reader)  # type: ignore[arg-type]
        rt.metrics.watch_tokens(lambda: self.payloads)
        # session\0next-state id -> parked record: a next state waiting for its interaction.
        # Its offset is committed already: process memory would lose it on SIGKILL.
        self.parked = rt.session_table(PARKED)
        # Hints from anywhere count (another judge, a person); verdicts come back through
        # their topic only from the judge agent.
        inputs: tuple[str, ...] = (names.INTERACTIONS, names.NEXT_STATES, names.HINTS)
        self.inputs = inputs if stage.judge_inline else (*inputs, names.PRM_SCORES)
        self.last_handled: Any = None  # the newest record whose batch is done (tests wait on it)
        # A batch and a timer on one session take turns from their read to their write.
        self.locks = KeyLocks()

    # ---- state ----------------------------------------------------------------------------

    async def read(self, key: bytes, raw: bytes | None = None) -> SessionState:
        """The session's state; one that cannot be read back is dead-lettered and restarted
        (never a crash on every redelivery)."""
        state = await self.rt.read_state(self.sessions, key, session_mod.load, "session state",
                                         raw)  # fmt: skip
        return SessionState() if state is None else state

    def save(self, key: bytes, state: SessionState) -> None:
        state.touched_ms = runtime.now_ms()
        self.sessions[key] = session_mod.dump(state)

    def kept_interaction(self, state: SessionState, turn: int) -> str | None:
        info = state.assembly.turns.get(turn)
        return info.interaction.event_id if info and info.interaction else None

    def keep_tokens(self, key: bytes, state: SessionState, inter: Interaction) -> None:
        """Hold the turn's token payload if the state keeps this interaction for the turn."""
        if self.kept_interaction(state, inter.turn) == inter.event_id:
            self.payloads.keep(key, inter)

    # ---- the stages' output ---------------------------------------------------------------

    async def publish(
        self,
        key: bytes,
        state: SessionState,
        step: Step,
        record: Any = None,
        consumed: events.Event | None = None,
    ) -> None:
        """``record`` is the Kafka record ``consumed`` came from: left out, it is dead-lettered
        with its own coordinates (``liverl dlq`` names the record; a replay finds it)."""
        rt = self.rt
        for nxt in step.next_states:
            await rt.send(names.NEXT_STATES, nxt)
        for pen in step.penalties:
            await rt.send(names.PATH_PENALTIES, pen)
        for nxt in step.parked:
            if is_derived(nxt):  # its turn was dropped by the state bound
                await rt.dead_letter_value(
                    names.resolve(names.NEXT_STATES, rt.ns), key, events.encode(nxt),
                    f"next state for turn {nxt.turn} of session {nxt.session_id}: the turn "
                    "is not in the judge state (over state_max_bytes)", nxt.event_id,
                )  # fmt: skip
                state.judging.pending.pop(nxt.event_id, None)
        for left in step.left_out:
            here = consumed is not None and left.event is consumed
            await rt.left_out(key, left, record if here else None)

    async def judge_all(self, state: SessionState, work: list[judging.JudgeWork]) -> None:
        """Judge inline (cheap judges), publish the verdicts and apply them."""
        results = await asyncio.gather(*(judging.judge_one(self.judge, w) for w in work))
        for res in results:
            await self.rt.send(names.PRM_SCORES, res.prm)
            for hint in res.hints:
                await self.rt.send(names.HINTS, hint)
            self.stage.on_verdict(state, res.prm, res.hints, runtime.now_ms())

    def unpark(self, key: bytes, state: SessionState, turn: int) -> list[judging.JudgeWork]:
        """The parked next states of ``turn``, now that it is known."""
        work = []
        for nid in self.stage.ready_parked(state, turn):
            raw = self.parked.get(parked_key(key, nid))
            if raw is None:  # only a state written before its record was parked is durable
                log.error("next state %s of %r (turn %s) was never parked", nid, key, turn)
                state.judging.pending.pop(nid, None)
                continue
            item = self.stage.take_parked(state, parked_next_state(raw))
            if item is not None:
                work.append(item)
        return work

    async def maybe_complete(self, key: bytes, state: SessionState) -> None:
        now = runtime.now_ms()
        if not self.assembler.ready(state.assembly, now):
            return
        kept = {t: info.interaction for t, info in state.assembly.turns.items()
                if info.interaction is not None and info.interaction.tokens is None}  # fmt: skip
        turns = list(kept)
        tokens = await self.payloads.gather(key, kept)
        result = self.assembler.complete(state.assembly, now, tokens)
        for r in result.rewards:
            await self.rt.send(names.REWARDS, r)
        gid = state.assembly.group_id
        if gid is None or not result.samples:
            for s in result.samples:
                await self.rt.send(names.SAMPLES, s)
        else:  # held by the group agent until its group is complete
            body = {
                "kind": "session",
                "session_id": state.assembly.session_id,
                "samples": [orjson.loads(events.encode(s)) for s in result.samples],
            }
            await self.rt.produce(
                self.group_topic.get_topic_name(), gid.encode(), orjson.dumps(body)
            )
        await self.rt.dead_letter_hints(
            key, result.unmatched_hints,
            "the session was assembled and that turn's interaction never arrived",
        )  # fmt: skip
        self.payloads.drop(key, turns)
        state.assembly = result.state

    async def complete_or_wait(self, key: bytes, state: SessionState) -> None:
        try:
            await self.maybe_complete(key, state)
        except KeyError as exc:  # an interaction not read back (yet): the sweep retries
            log.warning("session %r not assembled yet: %s", key, exc)

    # ---- the agent --------------------------------------------------------------------------

    async def process(self, stream: faust.StreamT) -> None:
        """Records in batches (``session_batch`` within ``session_batch_s``), each batch one
        unit: a session's records of a batch are applied in order to one state, read once
        and written once, so a burst of turns costs one changelog record, not one each."""
        rt, cfg = self.rt, self.rt.cfg
        async for evs in rt.unit_batches(stream, cfg.session_batch, within=cfg.session_batch_s):
            by_key: dict[bytes | None, list[Any]] = {}
            for raw_ev in evs:  # by the record's key: a session's records in their order
                by_key.setdefault(raw_ev.message.key, []).append(raw_ev)
            for records in by_key.values():
                async with contextlib.AsyncExitStack() as held:
                    await self.apply(records, held)
            if evs:
                self.last_handled = evs[-1].message

    async def apply(self, records: list[Any], held: contextlib.AsyncExitStack) -> None:
        """One session's records of a batch, applied in order to its state: read once (with
        the session's lock, held until the write), written once."""
        rt = self.rt
        state: SessionState | None = None
        dirty = False
        released: list[str] = []
        key = b""
        for raw_ev in records:  # decoded (or dead-lettered) in the session's order
            item = await rt.decode_one(raw_ev, self.inputs)
            if item is None:
                continue
            key, ev = item
            if state is None:
                await held.enter_async_context(self.locks.hold(key))
                state = await self.read(key)
            changed, freed = await self.handle(key, state, ev, raw_ev)
            dirty |= changed
            released += freed
        if state is None:
            return
        if released:  # verdicts acknowledged before the parked records are forgotten
            await rt.app.producer.flush()
            for nid in released:
                self.parked.pop(parked_key(key, nid), None)
        if dirty:
            self.save(key, state)

    async def handle(
        self, key: bytes, state: SessionState, ev: events.Event, raw_ev: Any
    ) -> tuple[bool, list[str]]:
        """Apply one record to its session's state: (whether the state changed, the parked
        next states it released, to forget once their verdicts are sent)."""
        rt, stage = self.rt, self.stage
        work: list[judging.JudgeWork] = []
        released: list[str] = []
        if isinstance(ev, events.Interaction):
            msg = raw_ev.message
            at = RecordAt(msg.topic, msg.partition, msg.offset)
            step = stage.on_interaction(state, ev, runtime.now_ms(), at)
            self.keep_tokens(key, state, ev)
            if stage.judge_inline:
                work = self.unpark(key, state, ev.turn)
                released = [w.state.event_id for w in work]
        elif isinstance(ev, events.NextState):
            step = stage.on_next_state(state, ev, runtime.now_ms())
            if not step.applied:
                return False, []  # our own, read back (or a redelivery): nothing to write
            for nxt in step.parked:  # this record, waiting for its turn
                self.parked[parked_key(key, nxt.event_id)] = park(raw_ev.message)
            step.parked = []
        elif isinstance(ev, events.PrmScore):
            stage.on_verdict(state, ev, [], runtime.now_ms())
            step = Step()
        elif isinstance(ev, events.Hint):
            outcome = stage.on_hint(state, ev)
            if outcome == "late":
                await rt.dead_letter(
                    raw_ev.message,
                    f"hint for turn {ev.turn} of session {ev.session_id} arrived after the "
                    "session was assembled (its samples have left; processors.hint_wait_s "
                    "makes closed sessions wait for hints)",
                )
            if outcome != "applied":
                return False, []  # known already (the inline judge's own), or dead-lettered
            step = Step()
        else:  # decode_one let only the input types through
            return False, []
        await self.publish(key, state, step, raw_ev.message, ev)
        work = [*step.work, *work]
        if work:
            await self.judge_all(state, work)
        await self.complete_or_wait(key, state)
        return True, released

    # ---- timers -----------------------------------------------------------------------------

    async def session_sweep(self) -> None:
        """Close idle sessions, dead-letter next states whose turn never came, and assemble
        closed sessions whose grace period is over."""
        cfg, stage = self.rt.cfg, self.stage
        idle_ms, grace_ms = int(cfg.idle_timeout_s * 1000), int(cfg.grace_s * 1000)
        for key in list(self.sessions.keys()):
            async with self.locks.hold(key):  # read after a batch's write, never before it
                raw = self.sessions.get(key)
                if raw is None:
                    continue
                state = await self.read(key, raw)
                now = runtime.now_ms()
                was = (state.pairing.closed, state.assembly.done, len(state.judging.pending))
                step = stage.on_idle(state, now, idle_ms) if not state.pairing.closed else Step()
                await self.publish(key, state, step)
                if step.work:
                    await self.judge_all(state, step.work)
                for nid, turn in stage.expired(state, now, grace_ms).items():
                    await self.rt.dead_letter_parked(self.parked, key, nid, turn)
                if not state.assembly.done and state.assembly.closed_at_ms is not None:
                    await self.complete_or_wait(key, state)
                if was != (state.pairing.closed, state.assembly.done,
                           len(state.judging.pending)):  # fmt: skip
                    self.save(key, state)

    async def expire_state(self) -> None:
        """Drop sessions untouched for ``retain_s``: tables stay bounded on long runs."""
        retain_s = self.rt.cfg.retain_s
        cutoff = runtime.now_ms() - int(retain_s * 1000)
        for key, raw in list(self.sessions.items()):
            if touched(raw) >= cutoff:
                continue
            async with self.locks.hold(key):
                raw = self.sessions.get(key)
                if raw is None or touched(raw) >= cutoff:  # gone, or touched by a batch
                    continue
                state = await self.read(key, raw)  # an unreadable one is dead-lettered
                if not state.assembly.done:
                    await self.rt.dead_letter_hints(
                        key, unmatched_hints(state.assembly),
                        f"the session state expired (processors.retain_s {retain_s:g}s) "
                        "before that turn's interaction arrived",
                    )  # fmt: skip
                self.sessions.pop(key, None)
        for tbl in (self.tokens, self.parked):
            self.rt.drop_orphans(tbl, self.sessions)
        self.payloads.drop_orphans(self.sessions)
