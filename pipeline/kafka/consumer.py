"""Batch event consumer with manual offset storage and dead-letter routing.

Offset protocol (why records are neither lost nor silently dropped):
1. ``poll_batch`` decodes every record; one that fails to decode or validate is produced
   to ``liverl.dlq.v1`` with its raw bytes, coordinates and the reason (a letter that would
   exceed ``kafka.max_event_bytes`` keeps a leading cut of the bytes plus their size and
   sha256, see :func:`pipeline.kafka.producer.bound_dead_letter`);
2. before the batch is returned, the DLQ producer is flushed: a dead letter that was not
   acknowledged raises, so its offset is never stored;
3. the caller processes ``batch.records`` and only then calls :meth:`EventConsumer.store`
   (or :meth:`commit`); offsets cover the dead letters too, so the consumer moves past them.
A crash before step 3 re-delivers the batch (at-least-once); sinks deduplicate by event id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeGuard, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from pipeline import __version__, events
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable, connection_of
from pipeline.kafka.producer import EventProducer
from pipeline.kafka.topics import event_types, load_specs

log = logging.getLogger(__name__)

E = TypeVar("E", bound=events.Event)
E_co = TypeVar("E_co", bound=events.Event, covariant=True)


@dataclass(frozen=True)
class Record(Generic[E_co]):
    """A decoded record; ``Record[Sample]`` says which event it carries (see :func:`carries`)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int
    event: E_co
    # The exact bytes and headers received, so a later stage can dead-letter them verbatim.
    value: bytes = b""
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass
class Batch:
    records: list[Record[events.Event]] = field(default_factory=list)
    dead_lettered: int = 0
    # (topic, partition) -> next offset to consume, covering valid and dead-lettered records.
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record[events.Event]]:
        return iter(self.records)


def carries(record: Record[events.Event], kind: type[E]) -> TypeGuard[Record[E]]:
    """Whether ``record`` carries a ``kind`` event; narrows the record itself (not only
    ``record.event``), so it can go where a ``Record[kind]`` is expected."""
    return isinstance(record.event, kind)


def coordinates(msg: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed message. The client types each one Optional
    because a hand-built Message may lack them; one from poll()/consume() always has them."""
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError(f"message without coordinates: {topic}[{partition}]@{offset}")
    return topic, partition, offset


def received_headers(msg: Message) -> list[tuple[str, bytes | None]]:
    """A consumed message's headers as (key, bytes or None) pairs, the form librdkafka returns.
    The client's type also admits a dict and str values (what produce() accepts)."""
    raw = msg.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    return [(k, v.encode() if isinstance(v, str) else v) for k, v in pairs]


def expected_types_from_specs(connection: Connectable) -> dict[str, str]:
    """topic -> event type, read from ``topics/``. A broken spec raises ``TopicSpecError``:
    it used to turn every type check off without a word."""
    return event_types(load_specs(connection_of(connection).specs_dir))


class EventConsumer:
    """Thin typed wrapper over confluent-kafka's Consumer that never stops on a bad record.

    Topics, the group id and the DLQ topic are live names; with ``kafka.namespace`` set they
    are the namespace's (``names.resolve``, idempotent), and records carry the topic they were
    read from, so offsets stored from a batch go to the topics actually consumed.
    """

    def __init__(
        self,
        connection: Connectable,
        *,
        group_id: str,
        topics: Iterable[str] | None = None,
        dlq: EventProducer | None = None,
        dlq_topic: str = names.DLQ,
        component: str = "consumer",
        expected_types: dict[str, str] | None = None,
        auto_offset_reset: str = "earliest",
        on_assign: Callable[[Consumer, list[TopicPartition]], None] | None = None,
        **extra: Any,
    ) -> None:
        kafka = connection_of(connection)
        ns = self.namespace = kafka.namespace
        group_id = names.resolve(group_id, ns)
        fetch_total = max(52428800, kafka.max_fetch_bytes * 2)
        conf = kafka.client_config(
            **{
                "group.id": group_id,
                "enable.auto.offset.store": False,
                "enable.auto.commit": True,
                "auto.commit.interval.ms": 1000,
                "auto.offset.reset": auto_offset_reset,
                "isolation.level": "read_committed",
                # The size policy (KafkaSettings): any record the broker accepted fits a fetch.
                "fetch.max.bytes": fetch_total,
                "max.partition.fetch.bytes": kafka.max_fetch_bytes,
                "receive.message.max.bytes": fetch_total + 1024 * 1024,
            }
        )
        conf.update(extra)
        self._consumer = Consumer(conf)
        self._dlq = dlq if dlq is not None else EventProducer(kafka, client_id=f"{group_id}-dlq")
        self._dlq_topic = names.resolve(dlq_topic, ns)
        self._component = component
        self._max_bytes = kafka.max_event_bytes
        expected = (
            expected_types if expected_types is not None else expected_types_from_specs(kafka)
        )
        self._expected = {names.resolve(t, ns): kind for t, kind in expected.items()}
        self.dead_lettered = 0
        if topics:
            self.subscribe(list(topics), on_assign=on_assign)

    @property
    def raw(self) -> Consumer:
        return self._consumer

    def subscribe(
        self,
        topics: list[str],
        on_assign: Callable[[Consumer, list[TopicPartition]], None] | None = None,
    ) -> None:
        kwargs: dict[str, Any] = {}
        if on_assign is not None:
            kwargs["on_assign"] = on_assign
        self._consumer.subscribe([names.resolve(t, self.namespace) for t in topics], **kwargs)

    def assign(self, partitions: list[TopicPartition]) -> None:
        if self.namespace:
            partitions = [
                TopicPartition(names.resolve(tp.topic, self.namespace), tp.partition, tp.offset)
                for tp in partitions
            ]
        self._consumer.assign(partitions)

    def poll_batch(self, max_records: int = 500, timeout: float = 1.0) -> Batch:
        """Up to ``max_records`` decoded records; bad ones are dead-lettered, not returned."""
        batch = Batch()
        # consume() blocks until it has max_records or the timeout passes, which on a quiet
        # topic adds the whole timeout to every record's latency. So wait for the first
        # record with poll(), then take whatever else is already fetched without waiting.
        first = self._consumer.poll(timeout)
        messages = [] if first is None else [first]
        if first is not None and max_records > 1:
            messages += self._consumer.consume(num_messages=max_records - 1, timeout=0)
        for msg in messages:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                if err.fatal():
                    raise KafkaException(err)
                log.warning("consumer error: %s", err)
                continue
            topic, partition, offset = coordinates(msg)
            batch.offsets[(topic, partition)] = offset + 1
            headers = received_headers(msg)
            try:
                event = events.decode(
                    msg.value() or b"",
                    expected_type=self._expected.get(topic),
                    max_bytes=self._max_bytes,
                    version_header=next(
                        (v for k, v in headers if k == events.VERSION_HEADER), None
                    ),
                )
            except events.EventValidationError as exc:
                self._dead_letter(msg, str(exc))
                batch.dead_lettered += 1
                continue
            except Exception as exc:  # noqa: BLE001 - one record must never stop a consumer
                self._dead_letter(msg, f"cannot decode: {type(exc).__name__}: {exc}"[:2000])
                batch.dead_lettered += 1
                continue
            ts = msg.timestamp()[1]
            batch.records.append(
                Record(
                    topic,
                    partition,
                    offset,
                    msg.key(),
                    ts,
                    event,
                    value=msg.value() or b"",
                    headers=tuple((k, v or b"") for k, v in headers),
                )
            )
        if batch.dead_lettered:
            # A dead letter must be durable before its offset can ever be stored.
            self._dlq.flush()
            self.dead_lettered += batch.dead_lettered
        return batch

    def store(self, batch: Batch) -> None:
        """Mark the batch processed; auto-commit (or :meth:`commit`) persists it."""
        if batch.offsets:
            self._consumer.store_offsets(
                offsets=[TopicPartition(t, p, o) for (t, p), o in batch.offsets.items()]
            )

    def commit(self, batch: Batch | None = None) -> None:
        """Synchronously commit ``batch`` (or every stored offset)."""
        if batch is not None:
            if not batch.offsets:
                return
            tps = [TopicPartition(t, p, o) for (t, p), o in batch.offsets.items()]
            self._consumer.commit(offsets=tps, asynchronous=False)
            return
        try:
            self._consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._NO_OFFSET:
                raise

    def close(self) -> None:
        try:
            self._dlq.flush()
        finally:
            self._consumer.close()

    def _dead_letter(self, msg: Message, reason: str) -> None:
        topic, partition, offset = coordinates(msg)
        letter = events.DeadLetter.wrap(
            msg.value(),
            topic=topic,
            partition=partition,
            offset=offset,
            error=reason,
            producer=events.Producer(component=self._component, version=__version__),
            key=msg.key(),
            headers=received_headers(msg),
        )
        log.warning("dead-lettered %s[%d]@%d: %s", topic, partition, offset, reason[:500])
        # EventProducer.send bounds the letter to the codec limit (payload truncated, size,
        # sha256 and coordinates kept).
        self._dlq.send(self._dlq_topic, letter, key=msg.key())
