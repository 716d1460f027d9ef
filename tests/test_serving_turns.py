"""A restarted gateway continues each open session's turn numbering from the log."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.serving.build import build_app
from pipeline.serving.errors import ApiError
from pipeline.serving.sessions import Sessions
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running
from pipeline.serving.turns import TurnLedger
from pipeline.settings import Settings

from .conftest import create_topic


def _doc(session: str, turn: int, done: bool = False) -> dict:
    return {"type": "interaction", "session_id": session, "turn": turn, "session_done": done}


def test_ledger_keeps_open_sessions_only() -> None:
    ledger = TurnLedger()
    for doc in [
        _doc("a", 0),
        _doc("a", 2),
        _doc("a", 1),
        _doc("b", 0),
        _doc("b", 1, done=True),
        _doc("b", 0),
        {"type": "next_state", "session_id": "c", "turn": 5},
        _doc("d", True),
        {"oops": 1},
        "not a dict",
    ]:
        ledger.add(doc)
    ledger.add_values([b"{not json", b'{"type": "interaction", "session_id": "e", "turn": 4}'])
    # a: highest turn 2 -> next 3; b closed (a stray later turn does not reopen it);
    # bools are not turns; e from raw bytes.
    assert ledger.open_sessions() == {"a": 3, "e": 5}


def test_the_log_says_who_owns_each_session_closed_ones_included() -> None:
    """Issue 37: a restarted gateway forgot every owner, so another user's key could rate a
    session it had served. The first interaction's ``user_id`` owns the session."""
    from pipeline.serving.auth import Caller

    ledger = TurnLedger()
    for doc in [
        {**_doc("a", 0), "user_id": "bob"},
        {**_doc("a", 1), "user_id": "mallory"},
        {**_doc("b", 0, done=True), "user_id": "carol"},
        _doc("c", 0),
        {**_doc("d", 0), "user_id": 7},
    ]:
        ledger.add(doc)
    assert ledger.owners == {"a": "bob", "b": "carol"}  # older events carry no user_id
    sessions = Sessions()
    sessions.seed(ledger.open_sessions(), ledger.owners)
    mallory = Caller("km", "mallory", operator=False, keyed=True)
    for sid in ("a", "b"):
        with pytest.raises(ApiError):
            sessions.check_owner(sid, mallory)
    sessions.check_owner("c", mallory)  # nobody known: not checked


def test_seed_never_moves_a_counter_back() -> None:
    sessions = Sessions()
    assert sessions.next_turn("a") == 0
    sessions.seed({"a": 0, "b": 4})
    assert sessions.next_turn("a") == 1
    assert sessions.next_turn("b") == 4


def _turns(settings: Settings, topic: str, session: str, expected: int) -> list[int]:
    consumer = Consumer(settings.kafka_client_config(**{"group.id": f"check-{topic}"}))
    md = consumer.list_topics(topic, timeout=10).topics[topic]
    consumer.assign([TopicPartition(topic, p, 0) for p in md.partitions])
    turns: list[int] = []
    deadline = time.monotonic() + 30
    while len(turns) < expected and time.monotonic() < deadline:
        for msg in consumer.consume(100, timeout=1.0):
            if msg.error() is None:
                event = events.decode(msg.value(), expected_type="interaction")
                if event.session_id == session:
                    turns.append(event.turn)
    consumer.close()
    return sorted(turns)


@pytest.mark.integration
def test_restarted_gateway_continues_turns(
    kafka_settings: Settings, admin, unique: str, tmp_path: Path
) -> None:
    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.serving.backends.hf import HFBackend

    topic = f"test.turns.{unique}"
    create_topic(admin, topic, 6)
    session = f"restart-{unique}"
    body = {
        "model": "liverl-tiny-v1",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    }

    def serve_turns(spool: str, count: int) -> None:
        cfg = ServeSettings(
            interactions_topic=topic,
            reload=False,
            spool_dir=tmp_path / spool,
            delivery_timeout_s=5.0,
        )
        backend = HFBackend(ensure_tiny_model(), workers=1)
        app = build_app(cfg, kafka_settings, backend)
        with running(app) as url, httpx.Client(timeout=60) as client:
            for _ in range(count):
                resp = client.post(
                    f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": session}
                )
                assert resp.status_code == 200, resp.text

    serve_turns("first", 3)  # shutdown flushes the recorder
    assert _turns(kafka_settings, topic, session, 3) == [0, 1, 2]
    serve_turns("second", 2)  # a new process: counters start empty, recovered from Kafka
    assert _turns(kafka_settings, topic, session, 5) == [0, 1, 2, 3, 4]
