"""The Faust app: thin agents over the pure stage logic.

Three agents over co-partitioned topics keyed by session id, each with a per-session table
(changelogged, so a worker that takes over a partition recovers its sessions), and one keyed by
group id:

- ``pairing``  interactions -> next_states + path_penalties (idle sweep closes sessions)
- ``judge``    interactions + next_states -> prm_scores + hints (batched, bounded concurrency)
- ``assemble`` interactions + next_states + prm_scores + path_penalties + hints
               -> rewards + samples once a session is closed and judged; a session with a
               ``group_id`` goes to the internal topic ``<app id>-groups`` instead, keyed by group
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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import faust
import orjson
from aiokafka.partitioner import murmur2
from faust.types import AgentT, TableT, TopicT

from pipeline import __version__, events
from pipeline.events import DeadLetter, Event, Producer
from pipeline.kafka import names
from pipeline.kafka import topics as kafka_topics
from pipeline.kafka.producer import bound_dead_letter
from pipeline.settings import Settings

from . import grouping, judging
from .config import ProcessorSettings
from .judges import Judge, make_judge
from .pairing import Pairer
from .penalties import load_rules
from .rewards import Assembler, token_payload

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
        # A restarted worker waits this long for its killed predecessor to leave the group.
        broker_session_timeout=cfg.session_timeout_s,
        broker_heartbeat_interval=min(3.0, cfg.session_timeout_s / 4),
    )
    # One session's state is one changelog value: bounded below the record limit (config.py).
    bound = {"text_chars": cfg.state_text_chars,
             "max_bytes": min(cfg.state_max_bytes, settings.kafka.max_event_bytes)}
    pairer = Pairer(load_rules(cfg.rules_path), cfg.pairing_version, **bound)
    assembler = Assembler(
        cfg.reward_version,
        cfg.sample_version,
        grace_ms=int(cfg.grace_s * 1000),
        outcome_wait_ms=int(cfg.outcome_wait_s * 1000),
    )
    judge = build_judge(cfg)
    # aiokafka logs every produce request at debug; building those records is ~7% of a busy
    # worker even when the handler drops them.
    logging.getLogger("aiokafka").setLevel(max(logging.INFO, logging.getLogger().level))
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

    pair_t, judge_t, asm_t = table("pairing"), table("judging"), table("assembly")
    # key session\0turn -> token payload, on the partition of the session (not of the key).
    tok_t = table("tokens")
    # Faust has no per-table partitioner hook, so the instance's method is replaced.
    tok_t.partition_for_key = (  # type: ignore[method-assign]
        lambda key: key_partition(key.split(b"\0", 1)[0], partitions)
    )
    # key session\0next-state id -> parked record (see park): next states waiting for their
    # interaction, on the session's partition. Process memory would lose them on SIGKILL,
    # their offsets being committed already. Same partitioner as the tokens (no hook: replaced).
    parked_t = table("judge_parked")
    parked_t.partition_for_key = tok_t.partition_for_key  # type: ignore[method-assign]
    # Written only in the group agent's stream, on the partition of the group id.
    group_t = table("groups", use_partitioner=False)  # group id -> index
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

    def load(tbl: TableT, key: bytes) -> dict[str, Any] | None:
        raw = tbl.get(key)
        return None if raw is None else orjson.loads(raw)

    def save(tbl: TableT, key: bytes, state: dict[str, Any]) -> None:
        state["touched_ms"] = now_ms()
        tbl[key] = orjson.dumps(state)

    @every(max(cfg.sweep_interval_s, min(60.0, cfg.retain_s / 4)))
    async def expire_state() -> None:
        """Drop sessions untouched for ``retain_s``: tables stay bounded on long runs."""
        cutoff = now_ms() - int(cfg.retain_s * 1000)
        for tbl in (pair_t, judge_t, asm_t):
            for key, raw in list(tbl.items()):
                if orjson.loads(raw).get("touched_ms", 0) < cutoff:
                    del tbl[key]
        for key in list(tok_t.keys()):  # token payloads of sessions that are gone
            if key.split(b"\0", 1)[0] not in asm_t:
                del tok_t[key]
        for key in list(parked_t.keys()):  # judge_grace dead-letters them long before
            if key.split(b"\0", 1)[0] not in judge_t:
                del parked_t[key]

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

    async def dead_letter_state(table_name: str, key: bytes, value: bytes, error: str) -> None:
        """Dead-letter a table value that cannot be read back (state another code version
        wrote, or a bug): the agent drops it and goes on instead of crashing on every retry.
        It has no Kafka coordinates of its own: the letter names the table's changelog and
        its id derives from the key."""
        changelog = f"{cfg.app_id}-{table_name}-changelog"
        letter = DeadLetter.wrap(value, topic=changelog, partition=0, offset=0, error=error,
                                 producer=dlq_producer, key=key)
        letter = dataclasses.replace(letter, event_id=events.derive_event_id(
            "dlq", [], dlq_producer.version, changelog, key.hex()))
        letter = bound_dead_letter(letter, settings.kafka.max_event_bytes)
        log.error("dead-lettered %s value for key %r: %s", table_name, key, error[:500])
        await send(names.DLQ, letter)

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

    async def decoded(
        stream: faust.StreamT, dlq_topics: tuple[str, ...]
    ) -> AsyncIterator[tuple[bytes, Event]]:
        async for ev in stream.events():
            item = await decode_one(ev, dlq_topics)
            if item is not None:
                yield item

    # ---- pairing ------------------------------------------------------------------------------

    async def emit_pairing(result: Any) -> None:
        for ns in result.next_states:
            await send(names.NEXT_STATES, ns)
        for pen in result.penalties:
            await send(names.PATH_PENALTIES, pen)

    @app.agent(topic(names.INTERACTIONS), name="pairing")
    async def pairing(stream: faust.StreamT) -> None:
        async for key, inter in decoded(stream, (names.INTERACTIONS,)):
            assert isinstance(inter, events.Interaction)  # decode_one checked the topic's type
            state = load(pair_t, key)
            result = pairer.on_interaction(state, inter, now_ms())
            save(pair_t, key, result.state)
            await emit_pairing(result)

    @every(cfg.sweep_interval_s)
    async def idle_sweep() -> None:
        timeout_ms = int(cfg.idle_timeout_s * 1000)
        for key, raw in list(pair_t.items()):
            state = orjson.loads(raw)
            if state.get("closed"):
                continue
            result = pairer.on_idle(state, now_ms(), timeout_ms)
            if result.state.get("closed"):
                save(pair_t, key, result.state)
                await emit_pairing(result)

    # ---- judge --------------------------------------------------------------------------------

    # Next-state ids being judged right now: judge_grace must not dead-letter them meanwhile.
    in_flight: set[str] = set()

    async def run_judge(work: list[judging.JudgeWork]) -> None:
        results = await asyncio.gather(*(judging.judge_one(judge, w) for w in work))
        for res in results:
            await send(names.PRM_SCORES, res.prm)
            for hint in res.hints:
                await send(names.HINTS, hint)

    async def release_parked(done: list[tuple[bytes, str]]) -> None:
        """Forget parked next states once their verdicts are acknowledged. Their offsets were
        committed long ago, so until then the table entry is the only copy; a restart in
        between judges them again (the same verdict id: downstream deduplicates by id)."""
        await app.producer.flush()
        for key, nid in done:
            state = load(judge_t, key)
            if state is not None and state.get("pending", {}).pop(nid, None) is not None:
                save(judge_t, key, state)
            parked_t.pop(parked_key(key, nid), None)
            in_flight.discard(nid)

    @app.agent(topic(names.INTERACTIONS, names.NEXT_STATES), name="judge")
    async def judge_agent(stream: faust.StreamT) -> None:
        # Batches: every ready next state of a batch is judged concurrently (the judge bounds
        # its own concurrency); offsets move on only after the batch's verdicts are sent.
        # Faust's StreamT declares take() but not take_events(), which its Stream has.
        async for evs in stream.take_events(  # type: ignore[attr-defined]
            cfg.judge_batch, within=0.1
        ):
            batch: list[judging.JudgeWork] = []
            unparked: list[tuple[bytes, str]] = []
            for raw_ev in evs:
                item = await decode_one(raw_ev, (names.NEXT_STATES,))
                if item is None:
                    continue
                key, ev = item
                state = load(judge_t, key)
                if isinstance(ev, events.Interaction):
                    state = judging.on_interaction(state, ev, **bound)
                    pending = state.get("pending", {})
                    for nid, entry in list(pending.items()):
                        raw = parked_t.get(parked_key(key, nid)) if entry[1] == ev.turn else None
                        if raw is None or nid in in_flight:
                            continue
                        ns = events.decode(Parked(raw).value)  # was valid when parked
                        assert isinstance(ns, events.NextState)  # only next states are parked
                        work = judging.take_ready(state, ns)
                        if work:
                            pending[nid] = entry  # kept until the verdict is acknowledged
                            in_flight.add(nid)
                            unparked.append((key, nid))
                            batch.append(work)
                elif isinstance(ev, events.NextState):
                    state, todo = judging.on_next_state(state, ev, now_ms())
                    for ns in todo:
                        work = judging.take_ready(state, ns)
                        if work:
                            batch.append(work)
                        else:
                            parked_t[parked_key(key, ns.event_id)] = park(raw_ev.message)
                else:  # decode_one let only the two input types through
                    continue
                save(judge_t, key, state)
            if batch:
                await run_judge(batch)
            if unparked:
                await release_parked(unparked)

    @every(cfg.sweep_interval_s)
    async def judge_grace() -> None:
        grace_ms = int(cfg.grace_s * 1000)
        for key, raw in list(judge_t.items()):
            state = orjson.loads(raw)
            gone = [n for n in judging.expired(state, now_ms(), grace_ms) if n not in in_flight]
            if not gone:
                continue
            for nid in gone:
                _, turn = state["pending"].pop(nid)
                parked = parked_t.get(parked_key(key, nid))
                if parked is None:  # only a state written before parking was durable
                    log.error("next state %s of %r (turn %s) expired unparked", nid, key, turn)
                    continue
                rec = Parked(parked)
                await dead_letter(
                    rec,
                    f"next state for unknown turn {turn} of session "
                    f"{key.decode(errors='replace')}: no interaction within {cfg.grace_s:g}s",
                )
                parked_t.pop(parked_key(key, nid), None)
            save(judge_t, key, state)

    # ---- rewards and samples -----------------------------------------------------------------

    async def maybe_complete(key: bytes, state: dict[str, Any]) -> dict[str, Any]:
        now = now_ms()
        if not assembler.ready(state, now):
            return state
        turns = [int(t) for t, info in state.get("turns", {}).items() if "interaction" in info]
        tokens = {}
        for t in turns:
            raw = tok_t.get(token_key(key, t))
            if raw is not None:
                tokens[t] = orjson.loads(raw)
        result = assembler.complete(state, now, tokens)
        for r in result.rewards:
            await send(names.REWARDS, r)
        gid = state.get("group_id")
        if gid is None or not result.samples:
            for s in result.samples:
                await send(names.SAMPLES, s)
        else:  # held by the group stage until its group is complete
            body = {
                "kind": "session",
                "session_id": state["session_id"],
                "samples": [orjson.loads(events.encode(s)) for s in result.samples],
            }
            await group_topic.send(key=gid.encode(), value=orjson.dumps(body))
        for t in turns:
            tok_t.pop(token_key(key, t), None)
        return result.state

    def kept_interaction(state: dict[str, Any] | None, turn: int) -> str | None:
        info = (state or {}).get("turns", {}).get(str(turn), {}).get("interaction")
        return info["event_id"] if info else None

    asm_topics = (
        names.INTERACTIONS,
        names.NEXT_STATES,
        names.PRM_SCORES,
        names.PATH_PENALTIES,
        names.HINTS,
    )

    @app.agent(topic(*asm_topics), name="assemble")
    async def assemble(stream: faust.StreamT) -> None:
        dlq = (names.PRM_SCORES, names.PATH_PENALTIES, names.HINTS)
        async for key, ev in decoded(stream, dlq):
            state = load(asm_t, key)
            if isinstance(ev, events.Interaction):
                before = kept_interaction(state, ev.turn)
                state = assembler.on_interaction(state, ev, keep_tokens=False)
                tkey = token_key(key, ev.turn)
                if kept_interaction(state, ev.turn) == ev.event_id and (
                    before != ev.event_id or tkey not in tok_t
                ):  # new, or it replaced another turn of the same number: its tokens
                    tok_t[tkey] = orjson.dumps(token_payload(ev))
            elif isinstance(ev, events.NextState):
                state = assembler.on_next_state(state, ev, now_ms())
            elif isinstance(ev, events.PrmScore):
                state = assembler.on_prm(state, ev)
            elif isinstance(ev, events.PathPenalty):
                state = assembler.on_penalty(state, ev)
            elif isinstance(ev, events.Hint):
                state = assembler.on_hint(state, ev)
            else:  # decode_one let only the five input types through
                continue
            state = await maybe_complete(key, state)
            save(asm_t, key, state)

    @every(cfg.sweep_interval_s)
    async def assemble_sweep() -> None:
        for key, raw in list(asm_t.items()):
            state = orjson.loads(raw)
            if state.get("done") or state.get("closed_at_ms") is None:
                continue
            try:
                new = await maybe_complete(key, state)
            except KeyError as exc:  # a token payload not (yet) there: retry next sweep
                log.warning("session %r not assembled yet: %s", key, exc)
                continue
            if new is not state:
                save(asm_t, key, new)

    # ---- groups: z-score within (group, step index) across sessions -------------------------

    group_timeout_ms = int(cfg.group_timeout_s * 1000)
    retain_ms = int(cfg.retain_s * 1000)

    def member_key(gid: bytes, sid: str) -> bytes:
        return gid + b"\0" + sid.encode()

    async def flush_group(gid: bytes, index: dict[str, Any]) -> None:
        members: dict[str, list[events.Sample]] = {}
        for sid in index["members"]:
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
        for sid in index["members"]:
            member_t.pop(member_key(gid, sid), None)
        index["done"] = True

    @app.agent(group_topic, name="group")
    async def group_agent(stream: faust.StreamT) -> None:
        async for ev in stream.events():
            gid, now = ev.message.key or b"", now_ms()
            try:
                body = orjson.loads(ev.message.value)
            except orjson.JSONDecodeError:
                continue  # only this app writes the topic: nothing else to do with it
            index = load(group_t, gid)
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
            elif index.get("done") and now - index.get("touched_ms", now) >= retain_ms:
                del group_t[gid]  # sweep of an old tombstone
                continue
            if grouping.is_complete(index, cfg.group_size, now, group_timeout_ms):
                await flush_group(gid, index)
            save(group_t, gid, index)

    @every(cfg.sweep_interval_s)
    async def group_sweep() -> None:
        """Ask the group agent to look at groups past their timeout (or long done)."""
        now = now_ms()
        for gid, raw in list(group_t.items()):
            index = orjson.loads(raw)
            due = (not index.get("done") and now - index["first_ms"] >= group_timeout_ms) or (
                index.get("done") and now - index.get("touched_ms", now) >= retain_ms
            )
            if due:
                await group_topic.send(key=gid, value=b'{"kind":"sweep"}')

    app.liverl_agents = (pairing, judge_agent, assemble, group_agent)
    app.liverl_timers = timers
    app.liverl_topics = {**out, "groups": group_topic}
    return app


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
    for tbl in app.tables.values():
        ct = tbl.changelog_topic
        name = ct.get_topic_name()
        config = {"cleanup.policy": "compact" if ct.compacting else "delete", **size}
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
