"""EventProducer.send: the key each event gets when the caller names none."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline import events
from pipeline.events.examples import examples
from pipeline.kafka.producer import EventProducer
from pipeline.settings import Settings


@pytest.fixture()
def sent(monkeypatch: pytest.MonkeyPatch) -> tuple[EventProducer, list[dict[str, Any]]]:
    # No broker: librdkafka connects lazily, and send_raw is where bytes would leave.
    producer = EventProducer(Settings(kafka={"bootstrap": "127.0.0.1:1"}))
    out: list[dict[str, Any]] = []
    monkeypatch.setattr(
        producer, "send_raw", lambda topic, value, **kw: out.append({"topic": topic, **kw})
    )
    return producer, out


def test_default_keys_follow_the_topic_specs(sent) -> None:
    producer, out = sent
    ex = examples()
    status, letter, inter = ex["serving_status"], ex["dlq"], ex["interaction"]
    for ev in (status, letter, inter, ex["weights"]):
        producer.send("t", ev)
    keys = [o["key"] for o in out]
    assert keys[0] == status.replica_id.encode()  # not its policy: one key per replica
    assert keys[1] == letter.original_key() and keys[1] is not None
    assert keys[2] == inter.session_id.encode()
    assert keys[3] == ex["weights"].policy_id.encode()


def test_an_explicit_key_wins(sent) -> None:
    producer, out = sent
    producer.send("t", examples()["serving_status"], key="mine")
    assert out[0]["key"] == "mine"
    assert out[0]["headers"] == events.headers(
        examples()["serving_status"], version=producer.codec_version
    )
