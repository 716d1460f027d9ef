"""Read-only views of a running pipeline: consumer lag per group, live weight versions."""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from pipeline.kafka.connection import Connectable, connection_of

TRANSIENT = {
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
}


def watermarks(consumer: Consumer, tp: TopicPartition, timeout: float,
               patience_s: float = 30.0) -> tuple[int, int]:
    """A partition's low and high offsets. Right after topics are created (``liverl up`` on
    a fresh broker) a partition may have no leader yet: that is retried for ``patience_s``
    instead of failing a component's start."""
    deadline = time.monotonic() + max(timeout, patience_s)
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=timeout)
            return int(low), int(high)
        except KafkaException as exc:
            code = exc.args[0].code() if exc.args else None
            if code not in TRANSIENT or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@dataclass(frozen=True)
class GroupLag:
    group: str
    state: str
    lag: int
    # topic -> summed lag over its partitions
    by_topic: dict[str, int]


def consumer_lag(
    connection: Connectable, prefix: str = "", timeout: float = 10.0
) -> list[GroupLag]:
    kafka = connection_of(connection)
    admin = AdminClient(kafka.client_config())
    listed = admin.list_consumer_groups(request_timeout=timeout).result(timeout)
    groups = sorted(
        (g for g in listed.valid if g.group_id.startswith(prefix)), key=lambda g: g.group_id
    )
    probe = Consumer(kafka.client_config(**{"group.id": "liverl-lag-probe"}))
    out: list[GroupLag] = []
    try:
        for group in groups:
            futs = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group.group_id)])
            committed = futs[group.group_id].result(timeout).topic_partitions or []
            by_topic: dict[str, int] = {}
            for tp in committed:
                if tp.offset < 0:
                    continue
                _low, high = probe.get_watermark_offsets(
                    TopicPartition(tp.topic, tp.partition), timeout=timeout
                )
                by_topic[tp.topic] = by_topic.get(tp.topic, 0) + max(0, high - tp.offset)
            state = getattr(group.state, "name", str(group.state))
            out.append(GroupLag(group.group_id, state, sum(by_topic.values()), by_topic))
    finally:
        probe.close()
    return out


def latest_weights(
    connection: Connectable, tail: int = 200, timeout: float = 10.0
) -> dict[str, dict]:
    """policy_id -> the newest ``weights`` event (as a dict) among the topic's last records."""
    from pipeline import events
    from pipeline.kafka import names
    from pipeline.kafka.consumer import coordinates

    consumer = Consumer(
        connection_of(connection).client_config(
            **{"group.id": "liverl-status", "enable.auto.commit": False}
        )
    )
    newest: dict[str, dict] = {}
    try:
        md = consumer.list_topics(names.WEIGHTS, timeout=timeout)
        topic = md.topics.get(names.WEIGHTS)
        if topic is None or topic.error is not None:
            return newest
        assignments, ends = [], {}
        for p in topic.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(names.WEIGHTS, p), timeout)
            if high > low:
                assignments.append(TopicPartition(names.WEIGHTS, p, max(low, high - tail)))
                ends[p] = high
        if not assignments:
            return newest
        consumer.assign(assignments)
        done: set[int] = set()
        while len(done) < len(ends):
            msgs = consumer.consume(500, timeout=2.0)
            if not msgs:
                break
            for msg in msgs:
                if msg.error() is not None:
                    continue
                _topic, partition, offset = coordinates(msg)
                if offset + 1 >= ends[partition]:
                    done.add(partition)
                try:
                    event = events.to_dict(events.decode(msg.value(), expected_type="weights"))
                except events.EventValidationError:
                    continue
                current = newest.get(event["policy_id"])
                if current is None or event["version"] >= current["version"]:
                    newest[event["policy_id"]] = event
    finally:
        consumer.close()
    return newest
