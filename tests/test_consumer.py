"""Consumer + DLQ on the real broker: a poison record never stops a consumer."""

from __future__ import annotations

import base64
import hashlib
import time
from dataclasses import replace

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import EventConsumer, EventProducer, names
from pipeline.settings import Settings

from .conftest import create_topic

pytestmark = pytest.mark.integration


def _dlq_letters(settings: Settings, source_topic: str, expected: int) -> list[events.DeadLetter]:
    """Read the shared DLQ topic from the start and keep this test's letters."""
    consumer = Consumer(
        settings.kafka_client_config(
            **{"group.id": f"dlq-reader-{source_topic}", "auto.offset.reset": "earliest"}
        )
    )
    md = consumer.list_topics(names.DLQ, timeout=10)
    consumer.assign([TopicPartition(names.DLQ, p, 0) for p in md.topics[names.DLQ].partitions])
    letters: list[events.DeadLetter] = []
    deadline = time.monotonic() + 30
    while len(letters) < expected and time.monotonic() < deadline:
        for msg in consumer.consume(500, timeout=1.0):
            if msg.error() is not None:
                continue
            letter = events.decode(msg.value(), expected_type="dlq")
            assert isinstance(letter, events.DeadLetter)
            if letter.source_topic == source_topic:
                letters.append(letter)
    consumer.close()
    return letters


def test_poison_records_go_to_dlq_and_consumer_goes_on(
    kafka_settings: Settings, admin, unique: str
) -> None:
    topic = f"test.dlq.{unique}"
    create_topic(admin, topic, 1)
    settings = kafka_settings.model_copy(deep=True)
    settings.kafka.max_event_bytes = 64 * 1024

    good = examples.interaction()
    good_a = replace(good, event_id="good-a", turn=1)
    good_b = replace(good, event_id="good-b", turn=2)
    good_c = replace(good, event_id="good-c", turn=3)
    missing_field = events.to_dict(good)
    del missing_field["response_logprobs"]
    wrong_type = events.to_dict(good)
    wrong_type["turn"] = "three"
    next_state = events.NextState(
        event_id="ns",
        producer=good.producer,
        session_id="s",
        turn=0,
        kind="user_reply",
        content="thanks",
        source="test",
    )
    oversized = replace(good, event_id="big", response_text="x" * (80 * 1024))

    producer = EventProducer(settings, client_id="test-dlq")
    plan: list[tuple[str, bytes]] = [
        ("valid", events.encode(good_a)),
        ("malformed", b'{"event_id": "x", "type": "interaction", '),
        ("valid", events.encode(good_b)),
        ("missing", orjson.dumps(missing_field)),
        ("wrongtype", orjson.dumps(wrong_type)),
        ("othertype", events.encode(next_state)),
        ("oversized", orjson.dumps(events.to_dict(oversized))),
        ("utf8", b'{"event_id": "\xff\xfe"}'),
        ("valid", events.encode(good_c)),
    ]
    for label, value in plan:
        producer.send_raw(topic, value, key=label.encode())
    producer.flush()

    group = f"g-{unique}"
    consumer = EventConsumer(
        settings,
        group_id=group,
        topics=[topic],
        component="test",
        expected_types={topic: "interaction"},
    )
    received: list[events.Event] = []
    dead = 0
    deadline = time.monotonic() + 60
    while len(received) + dead < len(plan) and time.monotonic() < deadline:
        batch = consumer.poll_batch(max_records=3, timeout=1.0)
        received.extend(r.event for r in batch.records)
        dead += batch.dead_lettered
        consumer.store(batch)
    consumer.commit()
    consumer.close()

    assert [e.event_id for e in received] == ["good-a", "good-b", "good-c"]
    assert dead == 6

    letters = sorted(_dlq_letters(kafka_settings, topic, 6), key=lambda d: d.source_offset)
    assert [d.source_offset for d in letters] == [1, 3, 4, 5, 6, 7]
    assert all(d.source_partition == 0 for d in letters)
    by_key = {d.original_key(): d for d in letters}
    assert "malformed JSON" in by_key[b"malformed"].error
    assert "response_logprobs" in by_key[b"missing"].error
    assert "'turn'" in by_key[b"wrongtype"].error
    assert "type" in by_key[b"othertype"].error and "next_state" in by_key[b"othertype"].error
    assert "exceeds" in by_key[b"oversized"].error
    assert "UTF-8" in by_key[b"utf8"].error
    # Byte-exact originals: what failed can be inspected and replayed...
    for label, value in plan:
        if label not in ("valid", "oversized"):
            assert by_key[label.encode()].original() == value
            assert base64.b64decode(by_key[label.encode()].original_b64) == value
    # ...unless the letter would exceed the codec limit itself (base64 grows it by 4/3): then
    # a leading cut, with the original's size and sha256 (and its coordinates, above).
    big, value = by_key[b"oversized"], dict(plan)["oversized"]
    assert len(events.encode(big)) <= settings.kafka.max_event_bytes
    assert value.startswith(big.original()) and len(big.original()) > 40 * 1024
    assert big.original_headers["liverl-dlq-original-bytes"] == str(len(value))
    assert big.original_headers["liverl-dlq-original-sha256"] == hashlib.sha256(value).hexdigest()

    # Offsets moved past the dead letters: the group has nothing left to read.
    again = EventConsumer(
        settings, group_id=group, topics=[topic], expected_types={topic: "interaction"}
    )
    leftover = again.poll_batch(timeout=5.0)
    again.close()
    assert len(leftover) == 0 and leftover.dead_lettered == 0


def test_round_trip_through_broker_keyed_by_session(
    kafka_settings: Settings, admin, unique: str
) -> None:
    topic = f"test.rt.{unique}"
    create_topic(admin, topic, 3)
    producer = EventProducer(kafka_settings)
    sent = [
        replace(examples.interaction(), event_id=f"e{i}", session_id=f"s{i % 4}", turn=i)
        for i in range(24)
    ]
    for event in sent:
        producer.send(topic, event)
    producer.flush()
    assert producer.delivered == len(sent)

    consumer = EventConsumer(
        kafka_settings,
        group_id=f"rt-{unique}",
        topics=[topic],
        expected_types={topic: "interaction"},
    )
    got = []
    deadline = time.monotonic() + 60
    while len(got) < len(sent) and time.monotonic() < deadline:
        batch = consumer.poll_batch(timeout=1.0)
        got.extend(batch.records)
        consumer.store(batch)
    consumer.close()
    assert sorted(r.event.event_id for r in got) == sorted(e.event_id for e in sent)
    assert {r.event.event_id: r.event for r in got} == {e.event_id: e for e in sent}
    # One session, one partition, in order.
    for session in {e.session_id for e in sent}:
        recs = [r for r in got if r.event.session_id == session]
        assert len({r.partition for r in recs}) == 1
        assert [r.event.turn for r in recs] == sorted(r.event.turn for r in recs)
        assert all(r.key == session.encode() for r in recs)
