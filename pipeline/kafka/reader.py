"""One-shot topic reads: a consumer that assigns partitions itself, never joins a group and
never commits, so reading a topic (``liverl tap``, replay, forget) leaves no group state on
the cluster and moves no one's offsets.

Stated once here: these settings were copied in three places, and a fetch size that fell
behind the size policy (``KafkaSettings.max_fetch_bytes``) in one copy would stall that
reader on the first large record.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from pipeline.kafka.connection import Connectable, connection_of
from pipeline.kafka.errors import ReadError

# librdkafka's default fetch.max.bytes (50 MiB): a fetch is never smaller than it.
_MIN_FETCH_TOTAL = 52428800


def one_shot_config(
    connection: Connectable,
    group_prefix: str,
    *,
    isolation_level: str = "read_committed",
    **extra: Any,
) -> dict[str, Any]:
    """librdkafka config of a one-shot reader: a throwaway ``group_prefix<random>`` group id
    (required by the client, never joined: callers ``assign``), no commits and no offset
    store, partition EOF events, fetch sizes that follow the size policy, then the
    connection's pass-through settings (SASL/SSL) and ``extra`` on top."""
    kafka = connection_of(connection)
    fetch_total = max(_MIN_FETCH_TOTAL, kafka.max_fetch_bytes * 2)
    return kafka.client_config(
        **{
            "group.id": f"{group_prefix}{uuid.uuid4().hex[:12]}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "isolation.level": isolation_level,
            "fetch.max.bytes": fetch_total,
            "max.partition.fetch.bytes": kafka.max_fetch_bytes,
            "receive.message.max.bytes": fetch_total + 1024 * 1024,
            **extra,
        }
    )


def one_shot_reader(
    connection: Connectable,
    group_prefix: str,
    *,
    isolation_level: str = "read_committed",
    **extra: Any,
) -> Any:
    """A confluent-kafka ``Consumer`` built from :func:`one_shot_config`."""
    from confluent_kafka import Consumer

    return Consumer(
        one_shot_config(connection, group_prefix, isolation_level=isolation_level, **extra)
    )


def read_to_end(
    connection: Connectable,
    topics: Iterable[str],
    handle: Callable[[Any], object],
    *,
    group_prefix: str,
    idle_timeout_s: float = 30.0,
) -> None:
    """Call ``handle`` on every record of ``topics`` (what it returns is ignored) from the
    low to the high watermark captured at start (topics the broker lacks are skipped). Raises
    :class:`ReadError` when a partition yields nothing for ``idle_timeout_s`` or a fetch
    fails: a partial read must not pass for a whole one."""
    from confluent_kafka import KafkaError, TopicPartition

    consumer = one_shot_reader(connection, group_prefix)
    try:
        todo: list[Any] = []
        ends: dict[tuple[str, int], int] = {}
        for topic in topics:
            meta = consumer.list_topics(topic, timeout=idle_timeout_s).topics.get(topic)
            if meta is None or meta.error is not None:
                continue
            for p in sorted(meta.partitions):
                low, high = watermarks(consumer, TopicPartition(topic, p), idle_timeout_s)
                if high > low:
                    todo.append(TopicPartition(topic, p, low))
                    ends[(topic, p)] = high
        if not todo:
            return
        consumer.assign(todo)
        pending = set(ends)
        last_progress = time.monotonic()
        while pending:
            msgs = consumer.consume(num_messages=1000, timeout=0.5)
            if not msgs and time.monotonic() - last_progress > idle_timeout_s:
                left = ", ".join(f"{t}[{p}]" for t, p in sorted(pending))
                raise ReadError(f"reading {left} stalled for {idle_timeout_s:.0f}s")
            for m in msgs:
                last_progress = time.monotonic()
                tp = (m.topic(), m.partition())
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(tp)
                        continue
                    raise ReadError(f"reading {tp[0]}[{tp[1]}]: {err}")
                if tp not in pending:
                    continue
                if m.offset() < ends[tp]:
                    handle(m)
                if m.offset() + 1 >= ends[tp]:
                    pending.discard(tp)
    finally:
        consumer.close()


def follow(
    connection: Connectable,
    offsets: dict[tuple[str, int], int],
    on_batch: Callable[[list[Any]], None],
    stop: Any,
    *,
    group_prefix: str,
    label: str,
) -> None:
    """Read on from ``offsets`` until ``stop`` (a ``threading.Event``) is set, never joining a
    group or committing: each poll's good records go to ``on_batch`` (an empty list on a
    quiet poll, so the caller can do timed work). A fatal error raises; others are logged."""
    import logging

    from confluent_kafka import KafkaError, TopicPartition

    log = logging.getLogger(__name__)
    consumer = one_shot_reader(connection, group_prefix)
    try:
        consumer.assign([TopicPartition(t, p, o) for (t, p), o in offsets.items()])
        while not stop.is_set():
            good = []
            for msg in consumer.consume(num_messages=500, timeout=0.5):
                err = msg.error()
                if err is None:
                    good.append(msg)
                elif err.fatal():
                    raise RuntimeError(f"{label}: {err}")
                elif err.code() != KafkaError._PARTITION_EOF:
                    log.warning("%s: %s", label, err)
            on_batch(good)
    finally:
        consumer.close()


def watermarks(consumer: Any, tp: Any, timeout_s: float) -> tuple[int, int]:
    """(low, high) of a partition, retried while its leader is being elected: a topic just
    created (``topics apply`` right before ``liverl up`` starts its readers) answers "not
    leader" for a moment, which must not kill a reader at start."""
    from confluent_kafka import KafkaError, KafkaException

    electing = {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
    }
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=timeout_s)
            return int(low), int(high)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            retry = (
                getattr(err, "retriable", lambda: False)()
                or getattr(err, "code", lambda: None)() in electing
            )
            if not retry or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def end_offsets(
    connection: Connectable, topics: Iterable[str], *, group_prefix: str, hint: str = ""
) -> dict[tuple[str, int], int]:
    """The high watermark of every partition of ``topics`` (where a catch-up ends and a
    follower starts). ``LookupError`` names a topic the broker lacks, with ``hint``."""
    from confluent_kafka import TopicPartition

    consumer = one_shot_reader(connection, group_prefix)
    try:
        out = {}
        for topic in topics:
            meta = consumer.list_topics(topic, timeout=30).topics.get(topic)
            if meta is None or meta.error is not None:
                raise LookupError(f"topic {topic} does not exist" + (f" ({hint})" if hint else ""))
            for p in meta.partitions:
                out[(topic, p)] = watermarks(consumer, TopicPartition(topic, p), 30.0)[1]
        return out
    finally:
        consumer.close()


Coordinates = tuple[str, int, int]  # (topic, partition, offset)
_SKIP_AHEAD = 64  # records read forward to the next wanted offset before seeking instead


def read_at(
    consumer: Any, wanted: Iterable[Coordinates], *, timeout_s: float = 10.0
) -> dict[Coordinates, Any]:
    """The records at ``wanted`` coordinates, read by a one-shot reader (:func:`one_shot_reader`)
    that this call assigns and leaves unassigned. A coordinate whose record is gone (retention,
    an erased record, an aborted transaction's) is left out of the answer. Offsets close
    together on one partition are read in one pass, others each from their own position.
    Raises :class:`ReadError` on a fetch error or when ``timeout_s`` passes first."""
    from confluent_kafka import KafkaError, TopicPartition

    by_tp: dict[tuple[str, int], list[int]] = {}
    for topic, partition, offset in sorted(set(wanted)):
        by_tp.setdefault((topic, partition), []).append(offset)
    found: dict[Coordinates, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for (topic, partition), offsets in by_tp.items():
            i = 0
            while i < len(offsets):
                consumer.assign([TopicPartition(topic, partition, offsets[i])])
                while i < len(offsets):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ReadError(f"reading {topic}[{partition}] at {offsets[i]} took "
                                        f"over {timeout_s:g}s")  # fmt: skip
                    msg = consumer.poll(min(left, 1.0))
                    if msg is None:
                        continue
                    err = msg.error()
                    if err is not None:
                        if err.code() != KafkaError._PARTITION_EOF:
                            raise ReadError(f"reading {topic}[{partition}]: {err}")
                        if (msg.topic(), msg.partition()) == (topic, partition) and (
                            msg.offset() <= offsets[i]
                        ):
                            i = len(offsets)  # the end comes first: the rest are gone
                        continue
                    at = msg.offset()
                    if msg.topic() != topic or msg.partition() != partition or at < offsets[i]:
                        continue  # fetched for an earlier assignment
                    while i < len(offsets) and offsets[i] < at:
                        i += 1  # skipped over: that record is gone
                    if i < len(offsets) and offsets[i] == at:
                        found[(topic, partition, at)] = msg
                        i += 1
                    if i < len(offsets) and offsets[i] - at > _SKIP_AHEAD:
                        break  # far ahead: seek there rather than read the records between
    finally:
        consumer.unassign()
    return found
