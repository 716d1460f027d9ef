"""Read-only views of a running pipeline: consumer lag per group, partition watermarks."""

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


def watermarks(
    consumer: Consumer, tp: TopicPartition, timeout: float, patience_s: float = 30.0
) -> tuple[int, int]:
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
