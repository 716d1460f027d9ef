"""The Faust app: thin agents over the pure stage logic (session.py, judging.py, grouping.py).

Agents over co-partitioned topics keyed by session id, with tables changelogged (a worker that
takes over a partition recovers its sessions), and one keyed by group id:

- ``session``  interactions + next_states + hints -> next_states + path_penalties + prm_scores
               + hints + rewards + samples: pairing, path penalties, judging and assembly of
               a session in one place, with one typed state per session (``sessions`` table).
               A turn is read once; the next state it derives is read back once and skipped.
               A session with a ``group_id`` goes to the internal topic ``<app id>-groups``
               instead, keyed by group. The sweep closes idle sessions, dead-letters next
               states whose turn never came and assembles sessions whose grace is over.
- ``judge``    only for a judge that is not inline (the LLM PRM: slow, batched, bounded
               concurrency): interactions + next_states -> prm_scores + hints, which the
               session agent then reads.
- ``group``    <app id>-groups -> samples, z-scored within (group, step index) once the group
               has ``group_size`` sessions or ``group_timeout_s`` passed (a group spans
               partitions of the session topics, hence the repartition by group id)

Token payloads (ids, log-probs: nearly all of an interaction's bytes) are written once per turn
to their own table (key ``session\0turn``, placed on the session's partition) instead of being
re-serialised into the changelog with every update of the session's state.

Timers only write tables that are placed by key (``use_partitioner``); the group tables are
placed by the current event's partition, so the group timer sends a ``sweep`` message through
the group topic and the agent does the writing.

Bad records go to the DLQ (never crash an agent): invalid or over ``kafka.max_event_bytes``,
and keyless ones (a session-keyed topic needs the session id as key). Dead letters are cut to
the codec limit (size, sha256 and coordinates kept); aiokafka's request and fetch sizes follow
the size policy in ``KafkaSettings``, so no record the broker accepted can stop a worker.

Every piece of pending state lives in a changelogged table (a next state parked until its
interaction arrives too), so SIGKILL loses nothing; timers wait until table recovery has
finished, and a timer's error is logged, never fatal. Verdict ids are deterministic, so the
duplicates a restart may produce (at-least-once) are removed by id downstream.

Run more workers with the same app id to scale out: Kafka's consumer group spreads the
partitions.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import faust
import orjson
from aiokafka.partitioner import murmur2
from faust.types import AgentT, TableT, TopicT
from pydantic import TypeAdapter, ValidationError

from pipeline import __version__, events
from pipeline.events import DeadLetter, Event, Producer
from pipeline.kafka import names
from pipeline.kafka import topics as kafka_topics
from pipeline.kafka.producer import bound_dead_letter
from pipeline.settings import Settings

from . import grouping, judging
from . import session as session_mod
from .config import ProcessorSettings
from .grouping import GroupIndex
from .judges import Judge, make_judge
from .judging import JudgeState
from .pairing import Pairer
from .penalties import load_rules
from .rewards import Assembler, TokenPayload, UnmatchedHint, token_payload, unmatched_hints
from .session import SessionStage, SessionState, Step, is_derived

log = logging.getLogger(__name__)

# The topics the agents read; what each carries comes from topics/ (kafka.topics.event_types).
INPUTS = (names.INTERACTIONS, names.NEXT_STATES, names.PRM_SCORES, names.PATH_PENALTIES,
          names.HINTS)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def build_judge(cfg: ProcessorSettings) -> Judge:
    return make_judge(
        cfg.judge,
        base_url=cfg.llm_base_url,
        model=cfg.llm_model,
        api_key=cfg.llm_api_key,
        votes=cfg.llm_votes,
        timeout_s=cfg.llm_timeout_s,
        retries=cfg.llm_retries,
        concurrency=cfg.llm_concurrency,
        hints=cfg.llm_hints,
    )


def key_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default (murmur2) partitioner gives ``key``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def token_key(session_key: bytes, turn: int) -> bytes:
    return session_key + b"\0" + str(turn).encode()


def parked_key(session_key: bytes, next_state_id: str) -> bytes:
    return session_key + b"\0" + next_state_id.encode()


def sample_of(doc: Any) -> events.Sample:
    """A held group member's sample document as its Sample (the group topic holds only
    samples, written by this app); EventValidationError for anything else, e.g. state written
    by another version of this code."""
    if not isinstance(doc, dict):
        raise events.EventValidationError(f"a held sample is {type(doc).__name__}, not a dict")
    ev = events.from_dict(doc)
    if not isinstance(ev, events.Sample):
        raise events.EventValidationError(f"a held sample is a {ev.type} event")
    return ev


def held_samples(raw: bytes) -> list[events.Sample]:
    """A group member's held samples (a JSON list of sample documents)."""
    try:
        docs = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise events.EventValidationError(f"held samples are not JSON: {exc}") from None
    if not isinstance(docs, list):
        raise events.EventValidationError("held samples are not a list")
    return [sample_of(d) for d in docs]


def park(msg: Any) -> bytes:
    """A consumed record as one table value: JSON coordinates, NUL, the value bytes verbatim
    (base64 would push an event near the codec limit over the record limit)."""
    meta = {
        "topic": msg.topic,
        "partition": msg.partition,
        "offset": msg.offset,
        "key": None if msg.key is None else base64.b64encode(msg.key).decode(),
        "headers": [[k, base64.b64encode(v or b"").decode()] for k, v in (msg.headers or [])],
    }
    return orjson.dumps(meta) + b"\0" + (msg.value or b"")


class Parked:
    """A record kept in a table: enough to decode it again or dead-letter it verbatim."""

    def __init__(self, raw: bytes) -> None:
        meta, self.value = raw.split(b"\0", 1)
        m = orjson.loads(meta)
        self.topic, self.partition, self.offset = m["topic"], m["partition"], m["offset"]
        self.key = None if m["key"] is None else base64.b64decode(m["key"])
        self.headers = [(k, base64.b64decode(v)) for k, v in m["headers"]]


@dataclass(slots=True)
class JudgeAgentState:
    """The judge agent's value per session (only when the judge is not inline)."""

    judging: JudgeState = field(default_factory=JudgeState)
    touched_ms: int = 0


_JUDGE_STATE: TypeAdapter[JudgeAgentState] = TypeAdapter(JudgeAgentState)
_GROUP_INDEX: TypeAdapter[GroupIndex] = TypeAdapter(GroupIndex)


def touched(raw: bytes) -> int:
    """When a stored session or judge state was last written."""
    try:
        return int(orjson.loads(raw).get("touched_ms", 0))
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 0


class ProcessorsApp(faust.App):
    """The Faust app, with handles on what it declared (tests drive the agents and timers;
    :func:`ensure_internal_topics` creates the internal topics)."""

    liverl_agents: tuple[AgentT, ...]
    liverl_timers: dict[str, Callable[[], Awaitable[None]]]
    liverl_topics: dict[str, TopicT]


def create_app(
    settings: Settings | None = None, cfg: ProcessorSettings | None = None
) -> ProcessorsApp:
    """Build the Faust app with its topics, tables, agents and timers."""
    settings = settings or Settings()
    cfg = cfg or ProcessorSettings()
    ns = settings.kafka.namespace  # a replay namespace: its topics, app id (= group) and tables
    if ns:
        cfg = cfg.model_copy(update={"app_id": names.resolve(cfg.app_id, ns)})
    # Stated once, in topics/: the partitions the tables must share with the session topics
    # and the event type of each input. A broken spec stops the worker here, loudly.
    specs = kafka_topics.load_specs(settings.topics.specs_dir,
                                    max_record_bytes=settings.kafka.max_record_bytes)
    types = kafka_topics.event_types(specs)
    expected = {t: types[t] for t in INPUTS}
    partitions = cfg.partitions or kafka_topics.session_partitions(specs)
    datadir = settings.state_dir / "processors" / cfg.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = ProcessorsApp(
        cfg.app_id,
        broker=f"kafka://{settings.bootstrap}",
        value_serializer="raw",
        key_serializer="raw",
        topic_partitions=partitions,
        topic_replication_factor=settings.topics.replication_factor or 1,
        store="memory://",
        datadir=str(datadir),
        web_enabled=cfg.web_enabled,
        web_port=cfg.web_port,
        consumer_auto_offset_reset=cfg.auto_offset_reset,
        producer_acks=-1,
        # The size policy (KafkaSettings): aiokafka's defaults (1 MB requests and fetches)
        # crash-looped the worker on any record over 1 MB the broker had accepted.
        producer_max_request_size=settings.kafka.max_record_bytes,
        consumer_max_fetch_size=settings.kafka.max_fetch_bytes,
        # aiokafka's 16 KB batches held one token payload or sample each, so every record
        # was its own produce request; 1 MiB batches and a 5 ms linger share them.
        producer_max_batch_size=1 << 20,
        producer_linger=0.005,
        # A restarted worker waits this long for its killed predecessor to leave the group.
        broker_session_timeout=cfg.session_timeout_s,
        broker_heartbeat_interval=min(3.0, cfg.session_timeout_s / 4),
    )
    # One session's state is one changelog value: bounded below the record limit (config.py).
    # Pairing and judging share that value: 2/5 of the bound each, the rest is the assembly's
    # (ids, votes and hints of the session's turns).
    part_bytes = min(cfg.state_max_bytes, settings.kafka.max_event_bytes) * 2 // 5
    judge = build_judge(cfg)
    inline = bool(getattr(judge, "inline", True))
    pairer = Pairer(load_rules(cfg.rules_path), cfg.pairing_version,
                    text_chars=cfg.state_text_chars, max_bytes=part_bytes)
    assembler = Assembler(
        cfg.reward_version,
        cfg.sample_version,
        grace_ms=int(cfg.grace_s * 1000),
        outcome_wait_ms=int(cfg.outcome_wait_s * 1000),
        hint_wait_ms=int(cfg.hint_wait(inline) * 1000),
    )
    stage = SessionStage(pairer, assembler, judge_inline=inline,
                         text_chars=cfg.state_text_chars, judge_max_bytes=part_bytes)
    # aiokafka and Faust's topics log every produce request at debug; building those records
    # was ~7% and ~5% of a busy worker even when the handler drops them.
    for noisy in ("aiokafka", "faust.topics"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))
    dlq_producer = Producer(component="processors", version=__version__)
    prefix = cfg.session_prefix.encode() if cfg.session_prefix else b""

    def topic(*names_: str) -> faust.TopicT:
        resolved = [names.resolve(n, ns) for n in names_]
        return app.topic(*resolved, value_type=bytes, value_serializer="raw", key_type=bytes)

    out = {n: topic(n) for n in (*INPUTS, names.REWARDS, names.SAMPLES, names.DLQ)}
    group_topic = app.topic(
        f"{cfg.app_id}-groups",
        internal=True,
        partitions=partitions,
        value_type=bytes,
        value_serializer="raw",
        key_type=bytes,
    )

    def table(name: str, use_partitioner: bool = True) -> TableT:
        # use_partitioner: timers (idle sweep, grace) may update a session outside a stream.
        return app.Table(
            name,
            default=None,
            key_type=bytes,
            value_type=bytes,
            partitions=partitions,
            use_partitioner=use_partitioner,
        )

    def by_session(tbl: TableT) -> TableT:
        """Keys ``session\\0…`` go to the session's partition, not the key's own. Faust has no
        per-table partitioner hook, so the instance's method is replaced."""
        tbl.partition_for_key = (  # type: ignore[method-assign]
            lambda key: key_partition(key.split(b"\0", 1)[0], partitions)
        )
        return tbl

    sess_t = table("sessions")  # session id -> SessionState (session.py)
    tok_t = by_session(table("tokens"))  # session\0turn -> token payload, written once a turn
    # session\0next-state id -> parked record (see park): a next state waiting for its
    # interaction. Its offset is committed already: process memory would lose it on SIGKILL.
    parked_t = by_session(table("parked"))
    # The judge agent's own state, when the judge is not inline (session.py).
    judge_t = judge_parked_t = None
    if not stage.judge_inline:
        judge_t = table("judging")  # session id -> JudgeAgentState
        judge_parked_t = by_session(table("judge_parked"))  # as parked, for the judge agent
    # Written only in the group agent's stream, on the partition of the group id.
    group_t = table("groups", use_partitioner=False)  # group id -> GroupIndex
    member_t = table("group_members", use_partitioner=False)  # group\0session -> samples
    timers: dict[str, Callable[[], Awaitable[None]]] = {}

    def tables_ready() -> bool:
        """Tables are recovered and no rebalance is under way: timers may read them (a sweep
        during recovery once saw a session without its token payloads and killed the worker)."""
        # Faust's TableManagerT omits recovery, which its TableManager has.
        recovery = app.tables.recovery  # type: ignore[attr-defined]
        return recovery.completed.is_set() and not recovery.in_recovery and not app.rebalancing

    def every(interval: float) -> Callable[[Any], Any]:
        """``app.timer`` that also keeps the bare coroutine function (unit tests call it).

        The scheduled timer skips its turn until :func:`tables_ready`, and logs an error
        instead of raising it (Faust stops the worker on a timer's exception)."""

        def register(fn: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
            timers[fn.__name__] = fn

            async def guarded() -> None:
                if not tables_ready():
                    return
                try:
                    await fn()
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - next interval retries
                    log.exception("timer %s failed; retrying next interval", fn.__name__)

            guarded.__name__ = guarded.__qualname__ = fn.__name__
            app.timer(interval)(guarded)
            return fn

        return register

    async def send(topic_name: str, ev: Event) -> None:
        v = settings.kafka.codec_version
        await out[topic_name].send(
            key=events.key(ev),
            value=events.encode(ev, version=v),
            headers=events.headers(ev, version=v),
        )

    async def dead_letter(msg: Any, error: str) -> None:
        """Dead-letter a consumed record (a Faust message or a :class:`Parked` one)."""
        letter = DeadLetter.wrap(
            msg.value,
            topic=msg.topic,
            partition=msg.partition,
            offset=msg.offset,
            error=error,
            producer=dlq_producer,
            key=msg.key,
            headers=list(msg.headers or []),
        )
        # Cut to the codec limit: a letter is base64, 4/3 of the record it carries.
        letter = bound_dead_letter(letter, settings.kafka.max_event_bytes)
        log.warning(
            "dead-lettered %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, error[:500]
        )
        await send(names.DLQ, letter)

    async def dead_letter_value(
        topic_name: str, key: bytes, value: bytes, error: str, *id_parts: str
    ) -> None:
        """Dead-letter bytes that have no Kafka coordinates of their own: a table value that
        cannot be read back (state another code version wrote, or a bug), or an event this
        worker derived and cannot use. The letter names the topic (a changelog, or the one the
        event was published to) and its id derives from ``id_parts``, so a retry writes the
        same letter."""
        letter = DeadLetter.wrap(value, topic=topic_name, partition=0, offset=0, error=error,
                                 producer=dlq_producer, key=key)
        letter = dataclasses.replace(letter, event_id=events.derive_event_id(
            "dlq", [], dlq_producer.version, topic_name, *id_parts))
        letter = bound_dead_letter(letter, settings.kafka.max_event_bytes)
        log.error("dead-lettered %s value for key %r: %s", topic_name, key, error[:500])
        await send(names.DLQ, letter)

    async def dead_letter_hints(key: bytes, hints: list[UnmatchedHint], why: str) -> None:
        """Hints that no sample will carry: the letter holds what the state kept of each."""
        sid = key.decode(errors="replace")
        for h in hints:
            doc = {"session_id": sid, "turn": h.turn, "hint_id": h.hint_id, "rank": h.rank,
                   "hint": h.hint}
            await dead_letter_value(
                names.HINTS, key, orjson.dumps(doc),
                f"hint {h.hint_id} for turn {h.turn} of session {sid}: {why}", h.hint_id,
            )

    async def dead_letter_state(table_name: str, key: bytes, value: bytes, error: str) -> None:
        changelog = f"{cfg.app_id}-{table_name}-changelog"
        await dead_letter_value(changelog, key, value, error, key.hex())

    async def decode_one(
        ev: faust.EventT, dlq_topics: tuple[str, ...]
    ) -> tuple[bytes, Event] | None:
        """The event if it is valid and one of our sessions; invalid or keyless ones of
        ``dlq_topics`` go to the DLQ (other agents reading the same topic skip them silently;
        the letter's id comes from the record's coordinates, so workers of other app ids or
        prefixes that dead-letter the same record write the same letter)."""
        msg = ev.message
        key = msg.key
        source = names.live(msg.topic, ns)  # expected and dlq_topics hold live names
        if not key:  # every input topic is keyed by session: all such records would share
            if source in dlq_topics:  # one empty-key session state
                await dead_letter(msg, "no Kafka key: this topic is keyed by session id")
            return None
        if prefix and not key.startswith(prefix):
            return None
        try:
            return key, events.decode(
                msg.value,
                expected_type=expected.get(source),
                max_bytes=settings.kafka.max_event_bytes,
            )
        except Exception as exc:  # noqa: BLE001 - EventValidationError, or anything else:
            if source in dlq_topics:  # one record must never stop an agent
                reason = (
                    str(exc)
                    if isinstance(exc, events.EventValidationError)
                    else (f"cannot decode: {type(exc).__name__}: {exc}"[:2000])
                )
                await dead_letter(msg, reason)
            return None

    # ---- the session agent: pairing, path penalties, judging, assembly --------------------------

    async def read_session(key: bytes, raw: bytes | None = None) -> SessionState:
        """The session's state; one that cannot be read back is dead-lettered and restarted
        (never a crash on every redelivery)."""
        raw = sess_t.get(key) if raw is None else raw
        if raw is None:
            return SessionState()
        try:
            return session_mod.load(raw)
        except ValidationError as exc:
            await dead_letter_state("sessions", key, raw, f"session state unreadable: {exc}")
            del sess_t[key]  # or every sweep would dead-letter it again
            return SessionState()

    def save_session(key: bytes, state: SessionState) -> None:
        state.touched_ms = now_ms()
        sess_t[key] = session_mod.dump(state)

    async def publish(key: bytes, state: SessionState, step: Step) -> None:
        for nxt in step.next_states:
            await send(names.NEXT_STATES, nxt)
        for pen in step.penalties:
            await send(names.PATH_PENALTIES, pen)
        for nxt in step.parked:
            if is_derived(nxt):  # its turn was dropped by the state bound
                await dead_letter_value(
                    names.resolve(names.NEXT_STATES, ns), key, events.encode(nxt),
                    f"next state for turn {nxt.turn} of session {nxt.session_id}: the turn "
                    "is not in the judge state (over state_max_bytes)", nxt.event_id,
                )
                state.judging.pending.pop(nxt.event_id, None)

    async def judge_all(state: SessionState, work: list[judging.JudgeWork]) -> None:
        """Judge inline (cheap judges), publish the verdicts and apply them."""
        results = await asyncio.gather(*(judging.judge_one(judge, w) for w in work))
        for res in results:
            await send(names.PRM_SCORES, res.prm)
            for hint in res.hints:
                await send(names.HINTS, hint)
            stage.on_verdict(state, res.prm, res.hints, now_ms())

    def unpark(key: bytes, state: SessionState, turn: int) -> list[judging.JudgeWork]:
        """The parked next states of ``turn``, now that it is known."""
        work = []
        for nid in stage.ready_parked(state, turn):
            raw = parked_t.get(parked_key(key, nid))
            if raw is None:  # only a state written before its record was parked is durable
                log.error("next state %s of %r (turn %s) was never parked", nid, key, turn)
                state.judging.pending.pop(nid, None)
                continue
            nxt = events.decode(Parked(raw).value)  # was valid when parked
            assert isinstance(nxt, events.NextState)  # only next states are parked
            item = stage.take_parked(state, nxt)
            if item is not None:
                work.append(item)
        return work

    async def maybe_complete(key: bytes, state: SessionState) -> None:
        now = now_ms()
        if not assembler.ready(state.assembly, now):
            return
        turns = [t for t, info in state.assembly.turns.items() if info.interaction is not None]
        tokens = {}
        for t in turns:
            raw = tok_t.get(token_key(key, t))
            if raw is not None:
                tokens[t] = TokenPayload.from_bytes(raw)
        result = assembler.complete(state.assembly, now, tokens)
        for r in result.rewards:
            await send(names.REWARDS, r)
        gid = state.assembly.group_id
        if gid is None or not result.samples:
            for s in result.samples:
                await send(names.SAMPLES, s)
        else:  # held by the group stage until its group is complete
            body = {
                "kind": "session",
                "session_id": state.assembly.session_id,
                "samples": [orjson.loads(events.encode(s)) for s in result.samples],
            }
            await group_topic.send(key=gid.encode(), value=orjson.dumps(body))
        await dead_letter_hints(
            key, result.unmatched_hints,
            "the session was assembled and that turn's interaction never arrived",
        )
        for t in turns:
            tok_t.pop(token_key(key, t), None)
        state.assembly = result.state

    async def complete_or_wait(key: bytes, state: SessionState) -> None:
        try:
            await maybe_complete(key, state)
        except KeyError as exc:  # a token payload not (yet) there: the sweep retries
            log.warning("session %r not assembled yet: %s", key, exc)

    def keep_tokens(key: bytes, before: str | None, state: SessionState, inter: Any) -> None:
        """Store the turn's token payload once: when it is new, or replaced another turn of
        the same number (a retry on another replica)."""
        tkey = token_key(key, inter.turn)
        if kept_interaction(state, inter.turn) == inter.event_id and (
            before != inter.event_id or tkey not in tok_t
        ):
            tok_t[tkey] = token_payload(inter).to_bytes()

    def kept_interaction(state: SessionState, turn: int) -> str | None:
        info = state.assembly.turns.get(turn)
        return info.interaction.event_id if info and info.interaction else None

    # Hints from anywhere count (another judge, a person); verdicts come back through their
    # topic only from the judge agent.
    session_inputs: tuple[str, ...] = (names.INTERACTIONS, names.NEXT_STATES, names.HINTS)
    if not stage.judge_inline:
        session_inputs += (names.PRM_SCORES,)

    @app.agent(topic(*session_inputs), name="session")
    async def session_agent(stream: faust.StreamT) -> None:
        async for raw_ev in stream.events():
            item = await decode_one(raw_ev, session_inputs)
            if item is None:
                continue
            key, ev = item
            state = await read_session(key)
            work: list[judging.JudgeWork] = []
            released: list[str] = []
            if isinstance(ev, events.Interaction):
                before = kept_interaction(state, ev.turn)
                step = stage.on_interaction(state, ev, now_ms())
                keep_tokens(key, before, state, ev)
                if stage.judge_inline:
                    work = unpark(key, state, ev.turn)
                    released = [w.state.event_id for w in work]
            elif isinstance(ev, events.NextState):
                step = stage.on_next_state(state, ev, now_ms())
                if not step.applied:
                    continue  # our own, read back (or a redelivery): nothing to write
                for nxt in step.parked:  # this record, waiting for its turn
                    parked_t[parked_key(key, nxt.event_id)] = park(raw_ev.message)
                step.parked = []
            elif isinstance(ev, events.PrmScore):
                stage.on_verdict(state, ev, [], now_ms())
                step = Step()
            elif isinstance(ev, events.Hint):
                outcome = stage.on_hint(state, ev)
                if outcome == "late":
                    await dead_letter(
                        raw_ev.message,
                        f"hint for turn {ev.turn} of session {ev.session_id} arrived after the "
                        "session was assembled (its samples have left; processors.hint_wait_s "
                        "makes closed sessions wait for hints)",
                    )
                if outcome != "applied":
                    continue  # known already (the inline judge's own), or dead-lettered
                step = Step()
            else:  # decode_one let only the input types through
                continue
            await publish(key, state, step)
            work = [*step.work, *work]
            if work:
                await judge_all(state, work)
            await complete_or_wait(key, state)
            if released:  # verdicts acknowledged before the parked records are forgotten
                await app.producer.flush()
                for nid in released:
                    parked_t.pop(parked_key(key, nid), None)
            save_session(key, state)

    @every(cfg.sweep_interval_s)
    async def session_sweep() -> None:
        """Close idle sessions, dead-letter next states whose turn never came, and assemble
        closed sessions whose grace period is over."""
        idle_ms, grace_ms = int(cfg.idle_timeout_s * 1000), int(cfg.grace_s * 1000)
        for key, raw in list(sess_t.items()):
            state = await read_session(key, raw)
            now = now_ms()
            was = (state.pairing.closed, state.assembly.done, len(state.judging.pending))
            step = stage.on_idle(state, now, idle_ms) if not state.pairing.closed else Step()
            await publish(key, state, step)
            if step.work:
                await judge_all(state, step.work)
            for nid, turn in stage.expired(state, now, grace_ms).items():
                parked = parked_t.get(parked_key(key, nid))
                if parked is None:
                    log.error("next state %s of %r expired unparked", nid, key)
                    continue
                await dead_letter(
                    Parked(parked),
                    f"next state for unknown turn {turn} of session "
                    f"{key.decode(errors='replace')}: no interaction within {cfg.grace_s:g}s",
                )
                parked_t.pop(parked_key(key, nid), None)
            if not state.assembly.done and state.assembly.closed_at_ms is not None:
                await complete_or_wait(key, state)
            if was != (state.pairing.closed, state.assembly.done, len(state.judging.pending)):
                save_session(key, state)

    @every(max(cfg.sweep_interval_s, min(60.0, cfg.retain_s / 4)))
    async def expire_state() -> None:
        """Drop sessions untouched for ``retain_s``: tables stay bounded on long runs."""
        cutoff = now_ms() - int(cfg.retain_s * 1000)
        for key, raw in list(sess_t.items()):
            if touched(raw) < cutoff:
                state = await read_session(key, raw)  # an unreadable one is dead-lettered
                if not state.assembly.done:
                    await dead_letter_hints(
                        key, unmatched_hints(state.assembly),
                        f"the session state expired (processors.retain_s {cfg.retain_s:g}s) "
                        "before that turn's interaction arrived",
                    )
                sess_t.pop(key, None)
        for tbl in (tok_t, parked_t):  # records of sessions that are gone
            for key in list(tbl.keys()):
                if key.split(b"\0", 1)[0] not in sess_t:
                    del tbl[key]
        if judge_t is not None and judge_parked_t is not None:
            for key, raw in list(judge_t.items()):
                if touched(raw) < cutoff:
                    del judge_t[key]
            for key in list(judge_parked_t.keys()):
                if key.split(b"\0", 1)[0] not in judge_t:
                    del judge_parked_t[key]

    # ---- the judge agent (judges that are not inline: the LLM PRM) -------------------------------

    if judge_t is not None and judge_parked_t is not None:
        jt, jpt = judge_t, judge_parked_t
        # Next-state ids being judged right now: judge_grace must not dead-letter them meanwhile.
        in_flight: set[str] = set()

        async def load_judge(key: bytes) -> JudgeAgentState:
            """Like :func:`read_session`: a value another code version wrote (the four-agent
            pipeline kept dicts in this table) is dead-lettered, never a crash loop."""
            raw = jt.get(key)
            if raw is None:
                return JudgeAgentState()
            try:
                return _JUDGE_STATE.validate_json(raw)
            except ValidationError as exc:
                await dead_letter_state("judging", key, raw, f"judge state unreadable: {exc}")
                del jt[key]
                return JudgeAgentState()

        def save_judge(key: bytes, state: JudgeAgentState) -> None:
            state.touched_ms = now_ms()
            jt[key] = _JUDGE_STATE.dump_json(state)

        async def run_judge(work: list[judging.JudgeWork]) -> None:
            results = await asyncio.gather(*(judging.judge_one(judge, w) for w in work))
            for res in results:
                await send(names.PRM_SCORES, res.prm)
                for hint in res.hints:
                    await send(names.HINTS, hint)

        async def release_parked(done: list[tuple[bytes, str]]) -> None:
            """Forget parked next states once their verdicts are acknowledged. Their offsets
            were committed long ago, so until then the table entry is the only copy; a restart
            in between judges them again (the same verdict id: downstream drops it by id)."""
            await app.producer.flush()
            for key, nid in done:
                state = await load_judge(key)
                if state.judging.pending.pop(nid, None) is not None:
                    save_judge(key, state)
                jpt.pop(parked_key(key, nid), None)
                in_flight.discard(nid)

        @app.agent(topic(names.INTERACTIONS, names.NEXT_STATES), name="judge")
        async def judge_agent(stream: faust.StreamT) -> None:
            # Batches: every ready next state of a batch is judged concurrently (the judge
            # bounds its own concurrency); offsets move on after the batch's verdicts are sent.
            # Faust's StreamT declares take() but not take_events(), which its Stream has.
            async for evs in stream.take_events(  # type: ignore[attr-defined]
                cfg.judge_batch, within=0.1
            ):
                batch: list[judging.JudgeWork] = []
                unparked: list[tuple[bytes, str]] = []
                for raw_ev in evs:
                    item = await decode_one(raw_ev, ())  # the session agent dead-letters
                    if item is None:
                        continue
                    key, ev = item
                    state = await load_judge(key)
                    if isinstance(ev, events.Interaction):
                        state.judging = judging.on_interaction(
                            state.judging, ev, text_chars=cfg.state_text_chars,
                            max_bytes=part_bytes,
                        )
                        for nid, entry in list(state.judging.pending.items()):
                            if entry.turn != ev.turn or nid in in_flight:
                                continue
                            raw = jpt.get(parked_key(key, nid))
                            if raw is None:
                                continue
                            nxt = events.decode(Parked(raw).value)  # was valid when parked
                            assert isinstance(nxt, events.NextState)  # only these are parked
                            work = judging.take_ready(state.judging, nxt)
                            if work:
                                state.judging.pending[nid] = entry  # kept until acknowledged
                                in_flight.add(nid)
                                unparked.append((key, nid))
                                batch.append(work)
                    elif isinstance(ev, events.NextState):
                        state.judging, todo = judging.on_next_state(state.judging, ev, now_ms())
                        for nxt in todo:
                            work = judging.take_ready(state.judging, nxt)
                            if work:
                                batch.append(work)
                            else:
                                jpt[parked_key(key, nxt.event_id)] = park(raw_ev.message)
                    else:
                        continue
                    save_judge(key, state)
                if batch:
                    await run_judge(batch)
                if unparked:
                    await release_parked(unparked)

        @every(cfg.sweep_interval_s)
        async def judge_grace() -> None:
            grace_ms = int(cfg.grace_s * 1000)
            for key in list(jt.keys()):
                state = await load_judge(key)
                gone = [
                    n for n in judging.expired(state.judging, now_ms(), grace_ms)
                    if n not in in_flight
                ]
                if not gone:
                    continue
                for nid in gone:
                    turn = state.judging.pending.pop(nid).turn
                    parked = jpt.get(parked_key(key, nid))
                    if parked is None:  # only a state written before parking was durable
                        log.error("next state %s of %r (turn %s) expired unparked", nid, key,
                                  turn)
                        continue
                    await dead_letter(
                        Parked(parked),
                        f"next state for unknown turn {turn} of session "
                        f"{key.decode(errors='replace')}: no interaction within "
                        f"{cfg.grace_s:g}s",
                    )
                    jpt.pop(parked_key(key, nid), None)
                save_judge(key, state)

        agents: tuple[AgentT, ...] = (session_agent, judge_agent)
    else:
        agents = (session_agent,)

    # ---- groups: z-score within (group, step index) across sessions -------------------------

    group_timeout_ms = int(cfg.group_timeout_s * 1000)
    retain_ms = int(cfg.retain_s * 1000)

    def member_key(gid: bytes, sid: str) -> bytes:
        return gid + b"\0" + sid.encode()

    async def read_group(gid: bytes) -> GroupIndex | None:
        """The group's index; one that cannot be read back is dead-lettered and dropped."""
        raw = group_t.get(gid)
        if raw is None:
            return None
        try:
            return _GROUP_INDEX.validate_json(raw)
        except ValidationError as exc:
            await dead_letter_state("groups", gid, raw, f"group index unreadable: {exc}")
            del group_t[gid]
            return None

    def save_group(gid: bytes, index: GroupIndex) -> None:
        index.touched_ms = now_ms()
        group_t[gid] = _GROUP_INDEX.dump_json(index)

    async def flush_group(gid: bytes, index: GroupIndex) -> None:
        members: dict[str, list[events.Sample]] = {}
        for sid in index.members:
            key = member_key(gid, sid)
            raw = member_t.get(key)
            if raw is None:
                continue
            try:
                members[sid] = held_samples(raw)
            except events.EventValidationError as exc:
                await dead_letter_state("group_members", key, raw,
                                        f"held samples of group member unreadable: {exc}")
        for s in grouping.normalize(gid.decode(), members, cfg.sample_version):
            await send(names.SAMPLES, s)
        for sid in index.members:
            member_t.pop(member_key(gid, sid), None)
        index.done = True

    @app.agent(group_topic, name="group")
    async def group_agent(stream: faust.StreamT) -> None:
        async for ev in stream.events():
            gid, now = ev.message.key or b"", now_ms()
            try:
                body = orjson.loads(ev.message.value)
            except orjson.JSONDecodeError:
                continue  # only this app writes the topic: nothing else to do with it
            index = await read_group(gid)
            if body.get("kind") == "session":
                index, action = grouping.on_session(index, body["session_id"], now)
                if action == "late":
                    log.warning(
                        "session %s arrived after group %r was emitted: not normalised",
                        body["session_id"],
                        gid,
                    )
                    try:
                        late = [sample_of(d) for d in body["samples"]]
                    except events.EventValidationError as exc:
                        await dead_letter(ev.message, f"late group member unreadable: {exc}")
                        late = []
                    for sample in late:
                        await send(names.SAMPLES, sample)
                elif action == "hold":
                    member_t[member_key(gid, body["session_id"])] = orjson.dumps(body["samples"])
            elif index is None:
                continue
            elif index.done and now - (index.touched_ms or now) >= retain_ms:
                del group_t[gid]  # sweep of an old tombstone
                continue
            if grouping.is_complete(index, cfg.group_size, now, group_timeout_ms):
                await flush_group(gid, index)
            save_group(gid, index)

    @every(cfg.sweep_interval_s)
    async def group_sweep() -> None:
        """Ask the group agent to look at groups past their timeout (or long done)."""
        now = now_ms()
        for gid, raw in list(group_t.items()):
            try:
                index = _GROUP_INDEX.validate_json(raw)
            except ValidationError:
                continue  # the agent dead-letters it when the group is next seen
            due = (not index.done and now - index.first_ms >= group_timeout_ms) or (
                index.done and now - (index.touched_ms or now) >= retain_ms
            )
            if due:
                await group_topic.send(key=gid, value=b'{"kind":"sweep"}')

    app.liverl_agents = (*agents, group_agent)
    app.liverl_timers = timers
    app.liverl_topics = {**out, "groups": group_topic}
    return app


# Compaction that keeps pace with the traffic. A restarted worker reads its changelogs back
# from the start, and Kafka compacts only closed segments (7 days by default): after a busy
# hour a worker read ~125,000 records (a token payload and its tombstone per turn, several
# states per session) for ~40 s before its first turn. Segments now close every 10 minutes,
# the cleaner runs once 10 % of a log is stale, every value is compacted within the hour
# (also the bound `liverl forget` states) and a tombstone lives 10 minutes after it.
CHANGELOG_COMPACTION = {
    "segment.ms": str(10 * 60_000),
    "min.cleanable.dirty.ratio": "0.1",
    "max.compaction.lag.ms": str(60 * 60_000),
    "delete.retention.ms": str(10 * 60_000),
}


def ensure_internal_topics(app: faust.App, settings: Settings, timeout: float = 60.0) -> list[str]:
    """Create Faust's changelog and assignor topics before the worker starts.

    Faust declares them itself, but on a broker that is still electing coordinators it can
    miss one, log "Ignoring missing topic" and crash the agent on its first table write.
    Creating them up front (idempotently) makes a fresh ``liverl up`` deterministic.
    """
    from confluent_kafka.admin import AdminClient, NewTopic

    replication = settings.topics.replication_factor or 1
    # The size policy: a changelog carries token payloads and parked records of up to
    # kafka.max_event_bytes, which a cluster's default topic limit (1 MB) would refuse.
    size = {"max.message.bytes": str(settings.kafka.max_record_bytes)}
    wanted: dict[str, NewTopic] = {}
    compacted: list[str] = []
    for tbl in app.tables.values():
        ct = tbl.changelog_topic
        name = ct.get_topic_name()
        config = {"cleanup.policy": "compact" if ct.compacting else "delete", **size}
        if ct.compacting:
            config.update(CHANGELOG_COMPACTION)
            compacted.append(name)
        wanted[name] = NewTopic(
            name, ct.partitions or app.conf.topic_partitions, replication, config=config
        )
    for t in getattr(app, "liverl_topics", {}).values():  # our internal (repartition) topics
        if getattr(t, "internal", False):
            name = t.get_topic_name()
            parts = t.partitions or app.conf.topic_partitions
            config = {"cleanup.policy": "delete", **size}
            wanted[name] = NewTopic(name, parts, replication, config=config)
    leader = f"{app.conf.id}-__assignor-__leader"
    wanted[leader] = NewTopic(leader, 1, replication, config={"cleanup.policy": "compact"})
    admin = AdminClient(settings.kafka_client_config())
    existing = admin.list_topics(timeout=timeout).topics
    missing = [t for n, t in wanted.items() if n not in existing]
    _set_compaction(admin, [n for n in compacted if n in existing], timeout)
    if missing:
        for name, fut in admin.create_topics(missing, request_timeout=timeout).items():
            try:
                fut.result(timeout)
            except Exception as exc:  # noqa: BLE001 - another worker may have won the race
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise RuntimeError(f"cannot create internal topic {name}: {exc}") from exc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        present = admin.list_topics(timeout=timeout).topics
        if all(n in present for n in wanted):
            return [t.topic for t in missing]
        time.sleep(0.2)
    raise RuntimeError(f"internal topics not visible after {timeout:.0f}s: {sorted(wanted)}")


def _set_compaction(admin: Any, names_: list[str], timeout: float) -> None:
    """Give changelogs created before :data:`CHANGELOG_COMPACTION` its settings (an
    incremental change: other settings stay). Best effort: a principal without the right to
    alter topic configs still runs, with slower restarts, and is told so."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    if not names_:
        return
    resources = [
        ConfigResource(
            "topic",
            name,
            incremental_configs=[
                ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
                for k, v in CHANGELOG_COMPACTION.items()
            ],
        )
        for name in names_
    ]
    for res, fut in admin.incremental_alter_configs(resources, request_timeout=timeout).items():
        try:
            fut.result(timeout)
        except Exception as exc:  # noqa: BLE001 - restarts get slower, nothing breaks
            log.warning("cannot set compaction settings of %s (%s): a restarted worker will "
                        "read more of it back", res.name, exc)
