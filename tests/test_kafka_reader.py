"""The one-shot reader (kafka/reader.py): the settings tap, replay and forget share, and a
read to the end of a topic that leaves no consumer group behind."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import Producer

from pipeline.kafka.connection import ConnectionSettings
from pipeline.kafka.errors import ReadError
from pipeline.kafka.reader import one_shot_config, one_shot_reader, read_at, read_to_end
from pipeline.settings import Settings

from .conftest import create_topic

SASL = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "PLAIN",
    "sasl.username": "u",
    "sasl.password": "p",
}


def test_the_config_never_commits_follows_the_size_policy_and_passes_sasl_through() -> None:
    conn = ConnectionSettings(
        bootstrap="b1:9092,b2:9092", client=SASL, max_event_bytes=64 * 1024 * 1024
    )
    conf = one_shot_config(conn, "liverl-x-")
    group = conf.pop("group.id")
    assert group.startswith("liverl-x-") and len(group) == len("liverl-x-") + 12
    fetch = 64 * 1024 * 1024 + 2 * 1024 * 1024  # event + record headroom + fetch headroom
    assert conf == {
        "bootstrap.servers": "b1:9092,b2:9092",
        **SASL,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "max.partition.fetch.bytes": fetch,
        "fetch.max.bytes": 2 * fetch,
        "receive.message.max.bytes": 2 * fetch + 1024 * 1024,
    }
    assert one_shot_config(conn, "liverl-x-")["group.id"] != group  # a fresh group each time


def test_small_events_keep_librdkafkas_fetch_floor_and_extra_settings_win() -> None:
    conn = ConnectionSettings(bootstrap="b:1", max_event_bytes=64 * 1024)
    conf = one_shot_config(
        conn,
        "p-",
        isolation_level="read_uncommitted",
        **{"fetch.wait.max.ms": 50, "max.partition.fetch.bytes": 2048},
    )
    assert conf["fetch.max.bytes"] == 52428800
    assert conf["receive.message.max.bytes"] == 52428800 + 1024 * 1024
    assert conf["isolation.level"] == "read_uncommitted"
    assert conf["fetch.wait.max.ms"] == 50 and conf["max.partition.fetch.bytes"] == 2048


def test_composed_settings_are_a_connection_and_the_reader_builds() -> None:
    settings = Settings(kafka={"bootstrap": "127.0.0.1:1", "client": SASL})
    conf = one_shot_config(settings, "p-")
    assert conf["bootstrap.servers"] == "127.0.0.1:1" and conf["sasl.username"] == "u"
    assert conf["max.partition.fetch.bytes"] == settings.kafka.max_fetch_bytes
    one_shot_reader(settings, "p-").close()  # a valid librdkafka config (nothing connects)


@pytest.mark.integration
def test_read_to_end_sees_every_record_and_joins_no_group(
    kafka_settings: Settings, admin: Any, unique: str
) -> None:
    topic = f"reader-{unique}"
    create_topic(admin, topic, 3)
    p = Producer(kafka_settings.kafka_client_config())
    for i in range(7):
        p.produce(topic, key=f"k{i}".encode(), value=f"v{i}".encode(), partition=i % 3)
    assert p.flush(30) == 0
    seen: list[bytes] = []
    read_to_end(
        kafka_settings,
        [topic, f"missing-{unique}"],
        lambda m: seen.append(m.value()),
        group_prefix=f"reader-{unique}-",
    )
    assert sorted(seen) == [f"v{i}".encode() for i in range(7)]
    groups = admin.list_consumer_groups().result(timeout=30).valid
    assert not [g for g in groups if g.group_id.startswith(f"reader-{unique}-")]


@pytest.mark.integration
def test_read_at_finds_records_by_coordinates_and_leaves_out_those_that_are_gone(
    kafka_settings: Settings, admin: Any, unique: str
) -> None:
    """Offsets close together are read in one pass, a far one from its own position; records
    deleted below the log start, past the end or on a partition read to its end are absent."""
    from confluent_kafka import TopicPartition

    topic = f"read-at-{unique}"
    create_topic(admin, topic, 2)
    p = Producer(kafka_settings.kafka_client_config())
    for i in range(200):
        p.produce(topic, value=f"a{i}".encode(), partition=0)
    for i in range(5):
        p.produce(topic, value=f"b{i}".encode(), partition=1)
    assert p.flush(30) == 0
    (fut,) = admin.delete_records([TopicPartition(topic, 0, 2)]).values()
    fut.result(30)  # offsets 0 and 1 of partition 0 are gone

    class Counting:  # the real reader, counting its positionings
        def __init__(self, inner: Any) -> None:
            self.inner, self.assigned = inner, []

        def assign(self, tps: list[Any]) -> None:
            self.assigned += [(tp.partition, tp.offset) for tp in tps]
            self.inner.assign(tps)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    reader = Counting(one_shot_reader(kafka_settings, f"read-at-{unique}-"))
    try:
        wanted = [(topic, 0, o) for o in (1, 3, 4, 40, 150, 199, 200)]
        wanted += [(topic, 1, 2), (topic, 1, 9)]
        found = read_at(reader, wanted, timeout_s=30)
    finally:
        reader.inner.close()
    assert {c: m.value() for c, m in found.items()} == {
        (topic, 0, 3): b"a3", (topic, 0, 4): b"a4", (topic, 0, 40): b"a40",
        (topic, 0, 150): b"a150", (topic, 0, 199): b"a199", (topic, 1, 2): b"b2",
    }  # fmt: skip
    # 1 (gone), 3, 4, 40 in one pass; 150 sought, 199 read on from it; partition 1 once
    assert reader.assigned == [(0, 1), (0, 150), (1, 2)]


def test_a_partition_that_stalls_is_a_read_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A partial read never passes for a whole one."""
    from pipeline.kafka import reader

    class Stalled:
        closed = False

        def list_topics(self, topic: str, timeout: float) -> Any:
            return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={0: 0})})

        def get_watermark_offsets(self, tp: Any, timeout: float) -> tuple[int, int]:
            return 0, 5

        def assign(self, tps: list[Any]) -> None:
            pass

        def consume(self, num_messages: int, timeout: float) -> list[Any]:
            return []

        def close(self) -> None:
            Stalled.closed = True

    monkeypatch.setattr(reader, "one_shot_reader", lambda *_a, **_k: Stalled())
    with pytest.raises(ReadError, match=r"reading t\[0\] stalled for 0s"):
        read_to_end(
            ConnectionSettings(bootstrap="b:1"),
            ["t"],
            lambda m: None,
            group_prefix="p-",
            idle_timeout_s=0.01,
        )
    assert Stalled.closed


def test_watermarks_wait_out_a_leader_election_and_raise_anything_else() -> None:
    from confluent_kafka import KafkaError, KafkaException

    from pipeline.kafka.reader import watermarks

    class Consumer:
        def __init__(self, errors: list[int]) -> None:
            self.errors, self.calls = errors, 0

        def get_watermark_offsets(self, tp: object, timeout: float) -> tuple[int, int]:
            self.calls += 1
            if self.errors:
                raise KafkaException(KafkaError(self.errors.pop(0)))
            return 3, 7

    electing = Consumer([KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE])
    assert watermarks(electing, "tp", 5.0) == (3, 7) and electing.calls == 3
    with pytest.raises(KafkaException):
        watermarks(Consumer([KafkaError.TOPIC_AUTHORIZATION_FAILED]), "tp", 5.0)
    with pytest.raises(KafkaException):  # still electing past the deadline
        watermarks(Consumer([KafkaError.NOT_LEADER_FOR_PARTITION] * 100), "tp", 0.3)
