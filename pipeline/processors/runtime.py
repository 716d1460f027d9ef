"""What every agent of the processors app shares: topics, tables, timers, sends, dead letters.

The agents (`session_agent.py`, `judge_agent.py`, `group_agent.py`) hold their own tables and
logic; this is the plumbing between them and Faust. One rule runs through it: a record is
never a reason to stop a worker. Bad input goes to the DLQ with its reason (:meth:`decode_one`,
:meth:`dead_letter`), table values that cannot be read back are dead-lettered and dropped
(:meth:`dead_letter_state`), and a timer's error is logged and retried next interval
(:meth:`every`). Each dead letter is counted, and so is each input left out by the feedback
policy, in :class:`WorkerMetrics`, served at ``/metrics`` when the web server is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import faust
import orjson
from faust.types import TableT, TopicT
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from pipeline import __version__, events
from pipeline.events import DeadLetter, Event, Producer
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable, connection_of
from pipeline.kafka.producer import bound_dead_letter

from . import ledger_consumer
from .config import ProcessorSettings
from .owned_keys import keep_owned_only
from .records import TABLE_SESSION, Parked, key_partition, parked_key, session_of
from .rewards import LeftOut, UnmatchedHint
from .state_json import StateUnreadable

log = logging.getLogger(__name__)

Timer = Callable[[], Awaitable[None]]
S = TypeVar("S")


def now_ms() -> int:
    """The agents' clock (unit tests replace it)."""
    return time.time_ns() // 1_000_000


class WorkerMetrics:
    """Counters of one worker process, one registry per app (tests build several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.dead_lettered = Counter(
            "liverl_workers_dead_lettered", "Records and values written to the DLQ",
            registry=self.registry,
        )  # fmt: skip
        self.left_out = Counter(
            "liverl_workers_inputs_left_out",
            "Inputs that count in no reward, by reason (each is dead-lettered too)",
            ["reason"], registry=self.registry,
        )  # fmt: skip

    def watch_tokens(self, store: Callable[[], Any]) -> None:
        """Gauges over the session agent's token store (`token_store.py`; ``store`` returns
        it): what it holds in memory and what it had to read back from the interactions
        topic."""
        for name, doc, read in (
            (
                "liverl_workers_token_payloads_held",
                "Turns whose tokens are held in memory",
                lambda: len(store()),
            ),
            (
                "liverl_workers_token_payloads_read_back",
                "Turns whose tokens were read back from their interaction (restart, rebalance)",
                lambda: store().read_back,
            ),
            (
                "liverl_workers_token_payloads_not_found",
                "Reads back that found no such interaction at the kept coordinates",
                lambda: store().not_found,
            ),
        ):
            Gauge(name, doc, registry=self.registry).set_function(read)

    def watch_offsets(self, app: Any) -> None:
        """Gauges over the consumer's offset ledger: records handed and not acknowledged,
        stale records fetched again, stalled records handed again (`ledger_consumer.py`)."""
        for name, doc, read in ledger_consumer.watched(app):
            Gauge(name, doc, registry=self.registry).set_function(read)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class Runtime:
    """Faust plumbing for one processors app (see the module docstring)."""

    def __init__(
        self,
        app: faust.App,
        kafka: Connectable,
        cfg: ProcessorSettings,
        *,
        partitions: int,
        expected: dict[str, str],
        outputs: tuple[str, ...],
    ) -> None:
        self.app, self.kafka, self.cfg = app, connection_of(kafka), cfg
        self.ns = self.kafka.namespace
        self.partitions = partitions
        self.expected = expected  # live topic name -> the event type it carries
        self.prefix = cfg.session_prefix.encode() if cfg.session_prefix else b""
        self.dlq_producer = Producer(component="processors", version=__version__)
        self.timers: dict[str, Timer] = {}
        self.out: dict[str, TopicT] = {n: self.topic(n) for n in outputs}
        self.metrics = WorkerMetrics()
        self.metrics.watch_offsets(app)
        if cfg.web_enabled:  # the only use liverl has for Faust's web server
            metrics = self.metrics

            async def metrics_page(view: Any, request: Any) -> Any:
                # aiohttp refuses a charset in content_type=; the header may carry it.
                return view.bytes(metrics.exposition(),
                                  headers={"Content-Type": CONTENT_TYPE_LATEST})  # fmt: skip

            app.page("/metrics")(metrics_page)

    # ---- units of work (exactly once: transactions.py) -------------------------------------

    def unit(self) -> contextlib.AbstractAsyncContextManager[None]:
        """One unit of work: the worker's transaction commits only between units, so a unit's
        outputs, state writes and input offsets are committed together. A no-op at least once
        (``[processors] exactly_once = false``) and in unit tests."""
        txn = getattr(self.app, "liverl_transaction", None)
        return txn.unit() if txn is not None else contextlib.nullcontext()

    async def units(self, stream: faust.StreamT) -> AsyncIterator[Any]:
        """``stream``'s events, each handled as one unit and acked inside it (Faust would ack
        it only when the next one is asked for, after the unit: a commit in between would hold
        its outputs but not its offset). The ack follows the ``yield``, so it runs only when
        the body asks for the next event: a unit that raised or was cancelled is never acked,
        and the commit stops before its record (handed again: ``ledger_consumer.py``)."""
        stream.enable_acks = False
        async for ev in stream.events():
            async with self.unit():
                yield ev
                await stream.ack(ev)

    async def unit_batches(
        self, stream: faust.StreamT, size: int, within: float
    ) -> AsyncIterator[Sequence[Any]]:
        """Faust's ``take_events`` batches, each one unit, acked inside it like :meth:`units`.
        ``take_events`` acks each event again when the next batch is asked for; one reference
        given back per event makes that second ack a no-op for a message another agent still
        holds (the judge agent shares interactions and next states with the session agent).
        A batch whose unit raised or was cancelled is not acked (see :meth:`units`), neither
        here nor by ``take_events`` when it is closed."""
        batches = stream.take_events(size, within=within)  # type: ignore[attr-defined]
        async for evs in batches:
            async with self.unit():
                try:
                    yield evs
                except BaseException:
                    # take_events acks the batch when it is closed: one reference more
                    # per event keeps that ack from reaching the consumer.
                    for ev in evs:
                        ev.message.incref()
                    raise
                for ev in evs:
                    await stream.ack(ev)
                    if not ev.message.acked:
                        ev.message.incref()

    # ---- declarations -------------------------------------------------------------------

    def topic(self, *names_: str) -> TopicT:
        resolved = [names.resolve(n, self.ns) for n in names_]
        return self.app.topic(*resolved, value_type=bytes, value_serializer="raw",
                              key_type=bytes)  # fmt: skip

    def table(self, name: str, use_partitioner: bool = True) -> TableT:
        """A bytes -> bytes table co-partitioned with the session topics. ``use_partitioner``:
        timers (idle sweep, grace) may write a session outside a stream. Only the tables of
        :data:`~.records.TABLE_SESSION`: forget must know how a table's keys name a session."""
        if name not in TABLE_SESSION:
            raise ValueError(f"table {name!r} is not in records.TABLE_SESSION")
        tbl = self.app.Table(
            name,
            default=None,
            key_type=bytes,
            value_type=bytes,
            partitions=self.partitions,
            use_partitioner=use_partitioner,
        )
        keep_owned_only(tbl, self.session_partition)
        return tbl

    def session_partition(self, key: bytes) -> int:
        """The partition of the session a table key names (``session`` or ``session\0…``)."""
        return key_partition(session_of(key), self.partitions)

    def session_table(self, name: str) -> TableT:
        """A table whose keys ``session\\0…`` go to the session's partition, not the key's own.
        Faust has no per-table partitioner hook, so the instance's method is replaced."""
        tbl = self.table(name)
        tbl.partition_for_key = self.session_partition  # type: ignore[method-assign]
        return tbl

    def tables_ready(self) -> bool:
        """Tables are recovered and no rebalance is under way: timers may read them (a sweep
        during recovery once saw a session without its token payloads and killed the worker)."""
        # Faust's TableManagerT omits recovery, which its TableManager has.
        recovery = self.app.tables.recovery  # type: ignore[attr-defined]
        return recovery.completed.is_set() and not recovery.in_recovery and not self.app.rebalancing

    def every(self, interval: float, fn: Timer) -> None:
        """``app.timer`` that also keeps the bare coroutine function under its name (unit
        tests call it). The scheduled timer skips its turn until :meth:`tables_ready`, and
        logs an error instead of raising it (Faust stops the worker on a timer's exception)."""
        name = fn.__name__
        self.timers[name] = fn

        async def guarded() -> None:
            if not self.tables_ready():
                return
            try:
                async with self.unit():
                    await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - next interval retries
                log.exception("timer %s failed; retrying next interval", name)

        guarded.__name__ = guarded.__qualname__ = name
        self.app.timer(interval)(guarded)

    # ---- output ---------------------------------------------------------------------------

    async def send(self, topic_name: str, ev: Event) -> None:
        v = self.kafka.codec_version
        await self.produce(
            self.out[topic_name].get_topic_name(),
            events.key(ev),
            events.encode(ev, version=v),
            events.headers(ev, version=v),
        )

    async def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Hand one record to the worker's producer (in exactly-once mode its transaction's;
        the default partitioner on the key, as Faust's ``Topic.send`` would). Straight to the
        producer, past Faust's topic layer (a future message, its callbacks and sensors per
        record), which took a third of a busy worker: ``bench/rewards.py`` 719–787 turns/s
        through ``Topic.send``, 1,025–1,039 this way, one worker, same runs. Like
        ``Topic.send`` it returns once the record is queued; a delivery that fails fails the
        transaction's commit (at least once: the producer retries, then logs)."""
        await self.app.producer.send(topic, key, value, None, None, headers)

    async def dead_letter(self, msg: Any, error: str) -> None:
        """Dead-letter a consumed record (a Faust message or a parked one)."""
        letter = DeadLetter.wrap(
            msg.value,
            topic=msg.topic,
            partition=msg.partition,
            offset=msg.offset,
            error=error,
            producer=self.dlq_producer,
            key=msg.key,
            headers=list(msg.headers or []),
        )
        # Cut to the codec limit: a letter is base64, 4/3 of the record it carries.
        letter = bound_dead_letter(letter, self.kafka.max_event_bytes)
        log.warning(
            "dead-lettered %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, error[:500]
        )
        await self.send(names.DLQ, letter)
        self.metrics.dead_lettered.inc()

    async def dead_letter_value(
        self,
        topic_name: str,
        key: bytes,
        value: bytes,
        error: str,
        *id_parts: str,
        level: int = logging.ERROR,
    ) -> None:
        """Dead-letter bytes that have no Kafka coordinates of their own: a table value that
        cannot be read back (state another code version wrote, or a bug), or an event this
        worker derived and cannot use. The letter names the topic (a changelog, or the one the
        event was published to) and its id derives from ``id_parts``, so a retry writes the
        same letter."""
        producer = self.dlq_producer
        letter = DeadLetter.wrap(value, topic=topic_name, partition=0, offset=0, error=error,
                                 producer=producer, key=key)  # fmt: skip
        letter = dataclasses.replace(letter, event_id=events.derive_event_id(
            "dlq", [], producer.version, topic_name, *id_parts))  # fmt: skip
        letter = bound_dead_letter(letter, self.kafka.max_event_bytes)
        log.log(level, "dead-lettered %s value for key %r: %s", topic_name, key, error[:500])
        await self.send(names.DLQ, letter)
        self.metrics.dead_lettered.inc()

    async def dead_letter_parked(self, table: TableT, key: bytes, nid: str, turn: int) -> None:
        """A parked next state whose turn never came within ``grace_s``: dead-lettered as the
        record it was, then forgotten."""
        pkey = parked_key(key, nid)
        parked = table.get(pkey)
        if parked is None:  # only a state written before its record was parked is durable
            log.error("next state %s of %r (turn %s) expired unparked", nid, key, turn)
            return
        await self.dead_letter(
            Parked(parked),
            f"next state for unknown turn {turn} of session "
            f"{key.decode(errors='replace')}: no interaction within {self.cfg.grace_s:g}s",
        )
        table.pop(pkey, None)

    async def dead_letter_hints(self, key: bytes, hints: list[UnmatchedHint], why: str) -> None:
        """Hints that no sample will carry: the letter holds what the state kept of each."""
        sid = key.decode(errors="replace")
        for h in hints:
            doc = {"session_id": sid, "turn": h.turn, "hint_id": h.hint_id, "rank": h.rank,
                   "hint": h.hint}  # fmt: skip
            await self.dead_letter_value(
                names.HINTS, key, orjson.dumps(doc),
                f"hint {h.hint_id} for turn {h.turn} of session {sid}: {why}", h.hint_id,
            )  # fmt: skip

    async def left_out(self, key: bytes, left: LeftOut, record: Any = None) -> None:
        """An input that counts in no reward: counted by reason, and dead-lettered as the
        record it was (``record``, when it is the one being consumed: the letter keeps its
        coordinates), as the event kept in the state, or, for a vote replaced after it had
        counted, as a description."""
        self.metrics.left_out.labels(left.reason).inc()
        if record is not None:
            await self.dead_letter(record, left.why)
            return
        value = orjson.dumps(left.detail) if left.event is None else events.encode(left.event)
        # A changed vote is ordinary use, not a fault: logged at info.
        level = logging.INFO if left.reason == "superseded" else logging.WARNING
        await self.dead_letter_value(names.resolve(names.NEXT_STATES, self.ns), key, value,
                                     left.why, left.event_id, left.reason, level=level)  # fmt: skip

    async def dead_letter_state(self, table_name: str, key: bytes, value: bytes,
                                error: str) -> None:  # fmt: skip
        changelog = f"{self.cfg.app_id}-{table_name}-changelog"
        await self.dead_letter_value(changelog, key, value, error, key.hex())

    # ---- state ----------------------------------------------------------------------------

    async def read_state(
        self,
        table: TableT,
        key: bytes,
        parse: Callable[[bytes], S],
        what: str,
        raw: bytes | None = None,
    ) -> S | None:
        """``table[key]`` (or ``raw``, its value already in hand) parsed, None when absent.
        A value that cannot be read back (another code version wrote it, or a bug) is
        dead-lettered as "``what`` unreadable" and dropped: never a crash on every
        redelivery, nor a letter on every sweep."""
        raw = table.get(key) if raw is None else raw
        if raw is None:
            return None
        try:
            return parse(raw)
        except StateUnreadable as exc:
            await self.dead_letter_state(table.name, key, raw, f"{what} unreadable: {exc}")
            del table[key]
            return None

    @staticmethod
    def drop_orphans(table: TableT, owners: TableT) -> None:
        """Delete the ``session\0…`` entries of ``table`` whose session ``owners`` no longer
        holds (records of sessions that are gone)."""
        for key in list(table.keys()):
            if session_of(key) not in owners:
                del table[key]

    # ---- input ----------------------------------------------------------------------------

    async def decode_one(
        self, ev: faust.EventT, dlq_topics: tuple[str, ...]
    ) -> tuple[bytes, Event] | None:
        """The event if it is valid and one of our sessions; invalid or keyless ones of
        ``dlq_topics`` go to the DLQ (other agents reading the same topic skip them silently;
        the letter's id comes from the record's coordinates, so workers of other app ids or
        prefixes that dead-letter the same record write the same letter)."""
        msg = ev.message
        key = msg.key
        source = names.live(msg.topic, self.ns)  # expected and dlq_topics hold live names
        if not key:  # every input topic is keyed by session: all such records would share
            if source in dlq_topics:  # one empty-key session state
                await self.dead_letter(msg, "no Kafka key: this topic is keyed by session id")
            return None
        if self.prefix and not key.startswith(self.prefix):
            return None
        try:
            return key, events.decode(
                msg.value,
                expected_type=self.expected.get(source),
                max_bytes=self.kafka.max_event_bytes,
            )
        except Exception as exc:  # noqa: BLE001 - EventValidationError, or anything else:
            if source in dlq_topics:  # one record must never stop an agent
                reason = (
                    str(exc)
                    if isinstance(exc, events.EventValidationError)
                    else (f"cannot decode: {type(exc).__name__}: {exc}"[:2000])
                )
                await self.dead_letter(msg, reason)
            return None
