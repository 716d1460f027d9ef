"""Recording survives a Kafka outage (every interaction arrives exactly once, in order) and a
spool damaged on disk (the frames after the damage are delivered, the damage is kept)."""

from __future__ import annotations

import dataclasses
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import names, topics
from pipeline.kafka.broker import LocalBroker
from pipeline.serving.build import build_app
from pipeline.serving.recorder import UNKNOWN_TOPIC, Recorder, frame
from pipeline.serving.settings import ServeSettings
from pipeline.serving.spool import Spool
from pipeline.serving.threaded import running
from pipeline.settings import BrokerSettings, Settings
from pipeline.stack import free_port

from .conftest import create_topic
from .test_serving_robustness import consume_all

MODEL = "liverl-tiny-v1"


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _wait(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.integration
def test_outage_spools_and_drains_exactly_once(tmp_path: Path) -> None:
    broker_cfg = BrokerSettings(port=free_port(), controller_port=free_port())
    settings = Settings(state_dir=tmp_path / "state", broker=broker_cfg)
    settings.kafka.bootstrap = None  # its own broker, even when LIVERL_KAFKA_BOOTSTRAP is set
    local = LocalBroker(settings)
    try:
        local.up(quiet=True)
        admin = AdminClient(settings.kafka_client_config())
        specs = [
            s
            for s in topics.load_specs(settings.topics.specs_dir)
            if s.name in (names.INTERACTIONS, names.WEIGHTS, names.SERVING_STATUS)
        ]
        topics.apply(admin, topics.plan(admin, specs))
        cfg = ServeSettings(
            model_path="tiny", spool_dir=tmp_path / "spool", delivery_timeout_s=2.0, reload=False
        )
        sent: list[str] = []
        app = build_app(cfg, settings)
        with running(app) as url, httpx.Client(timeout=60) as c:

            def ask(i: int) -> None:
                body = {
                    "model": MODEL,
                    "max_tokens": 3,
                    "messages": [{"role": "user", "content": f"question {i}"}],
                }
                resp = c.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={"X-Session-Id": f"sess-{i % 3}"},
                )
                assert resp.status_code == 200, resp.text
                sent.append(f"sess-{i % 3}/{resp.headers['x-liverl-turn']}")

            for i in range(6):
                ask(i)
            assert _wait(lambda: _metric(url, "liverl_gateway_record_backlog") == 0, 30)
            local.down(quiet=True)
            for i in range(6, 18):
                ask(i)  # all answered while Kafka is down
            assert _metric(url, "liverl_gateway_record_backlog") > 0
            assert _metric(url, "liverl_gateway_spool_bytes") > 0
            time.sleep(3)  # past the delivery timeout: the failed batch is retried later
            assert _metric(url, "liverl_gateway_record_backlog") > 0
            local.up(quiet=True)
            assert _wait(lambda: _metric(url, "liverl_gateway_record_backlog") == 0, 90)
        assert app.state.recorder.redelivered > 0, "the outage outlasted a delivery timeout"

        consumer = Consumer(
            settings.kafka_client_config(**{"group.id": "verify", "auto.offset.reset": "earliest"})
        )
        consumer.subscribe([names.INTERACTIONS])
        got: list[events.Interaction] = []
        deadline = time.monotonic() + 60
        while len(got) < len(sent) + 5 and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                if len(got) >= len(sent):
                    break
                continue
            if msg.error() is None:
                ev = events.decode(msg.value(), expected_type="interaction")
                assert isinstance(ev, events.Interaction)
                got.append(ev)
        consumer.close()
        found = [f"{e.session_id}/{e.turn}" for e in got]
        assert sorted(found) == sorted(sent), "every interaction exactly once"
        assert len({e.event_id for e in got}) == len(got)
        for s in ("sess-0", "sess-1", "sess-2"):
            turns = [e.turn for e in got if e.session_id == s]
            assert turns == sorted(turns), "order kept within a session"
    finally:
        local.down(quiet=True)


# ---- a spool frame damaged on disk (issue 11) -------------------------------------------------


def _spool_with_damage(directory: Path, topic: str, n: int) -> tuple[list[str], bytes]:
    """A spool holding ``n`` interactions whose second frame has a flipped byte; the ids of
    the undamaged ones and the damaged frame's bytes."""
    base = examples.interaction()
    evs = [dataclasses.replace(base, event_id=f"spooled-{i}", turn=i) for i in range(n)]
    spool = Spool(directory)
    spool.append([frame(topic, ev) for ev in evs])
    spool.close()
    seg = next(directory.glob("*.log"))
    data = bytearray(seg.read_bytes())
    first = 8 + struct.unpack_from(">I", data, 0)[0]
    size = 8 + struct.unpack_from(">I", data, first)[0]
    data[first + 8 + 100] ^= 0x01  # inside the second payload
    seg.write_bytes(bytes(data))
    return [ev.event_id for i, ev in enumerate(evs) if i != 1], bytes(data[first : first + size])


def _dead_kafka() -> Settings:
    s = Settings()
    s.kafka.bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    return s


def test_a_damaged_spool_frame_is_counted_and_degrades_health(tmp_path: Path) -> None:
    _spool_with_damage(tmp_path / "spool", names.INTERACTIONS, 3)
    cfg = ServeSettings(
        model_path="tiny",
        spool_dir=tmp_path / "spool",
        reload=False,
        turn_recovery_s=0,
        delivery_timeout_s=1.0,
    )
    app = build_app(cfg, _dead_kafka())
    with running(app) as url, httpx.Client(timeout=60) as c:
        assert _wait(lambda: _metric(url, "liverl_gateway_spool_quarantined_total") == 1, 10)
        health = c.get(f"{url}/healthz")
        assert health.status_code == 503
        doc = health.json()
        assert doc["status"] == "degraded" and doc["spool_quarantined"] == 1
        assert any("quarantined" in r and "spool" in r for r in doc["reasons"]), doc
        # recording itself works: turns that train are still served
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert c.post(f"{url}/v1/chat/completions", json=body).status_code == 200
        for bad in (tmp_path / "spool" / "quarantine").glob("*.bad"):
            bad.unlink()  # an operator dealt with it
        assert c.get(f"{url}/healthz").json()["reasons"] == []


@pytest.mark.integration
def test_events_after_a_damaged_spool_frame_reach_kafka(
    kafka_settings: Settings, admin: Any, unique: str, tmp_path: Path
) -> None:
    topic, dlq = f"test.interactions.{unique}", f"test.dlq.{unique}"
    create_topic(admin, topic)
    create_topic(admin, dlq)
    directory = tmp_path / "spool"
    good, damaged = _spool_with_damage(directory, topic, 4)
    spool = Spool(directory)
    spool.append([b"crc fine, not a frame"])  # unreadable content, e.g. from another tool
    rec = Recorder(kafka_settings, spool, dlq_topic=dlq, delivery_timeout_s=5)
    rec.start()
    later = dataclasses.replace(examples.interaction(), event_id="recorded-later", turn=9)
    try:
        rec.record(topic, later)
        assert _wait(lambda: rec.backlog == 0, 30)
        assert rec.alive
    finally:
        rec.close()
    got = consume_all(kafka_settings, topic, 4)
    assert [e.event_id for e in got] == [*good, "recorded-later"]
    letters = consume_all(kafka_settings, dlq, 2)
    assert len(letters) == 2 and rec.quarantined == 2
    by_topic = {ltr.source_topic: ltr for ltr in letters}
    assert by_topic[topic].original() == damaged, "the damaged bytes, verbatim"
    assert "corrupt spool frame" in by_topic[topic].error and "quarantine/" in by_topic[topic].error
    assert by_topic[UNKNOWN_TOPIC].original() == b"crc fine, not a frame"
    kept = sorted(p.read_bytes() for p in (directory / "quarantine").glob("*.bad"))
    assert kept == sorted([damaged, b"crc fine, not a frame"])


def test_a_drainer_that_keeps_failing_on_the_spool_is_reported(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    _spool_with_damage(directory, names.INTERACTIONS, 3)
    (directory / "quarantine").write_text("")  # a file where the folder should be
    rec = Recorder(_dead_kafka(), Spool(directory), delivery_timeout_s=1.0)
    rec.start()
    try:
        assert _wait(lambda: rec.quarantine_problem() is not None, 15)
        problem = rec.quarantine_problem()
        assert problem and "not being sent" in problem and "quarantine" in problem
        (directory / "quarantine").unlink()  # fixed: the damaged frame can be set aside now
        assert _wait(lambda: "quarantined in" in (rec.quarantine_problem() or ""), 15)
        assert rec.quarantined == 1
    finally:
        rec.close(timeout=1.0)


@pytest.mark.parametrize("linger_s", [0.0, 0.3])
def test_sparse_events_share_a_spool_batch_after_the_linger(
    tmp_path: Path, linger_s: float
) -> None:
    appends: list[int] = []

    class Counting(Spool):
        def append(self, payloads: list[bytes]) -> None:
            appends.append(len(payloads))
            super().append(payloads)

    # No broker here: the drainer's delivery is not what this looks at (the spool keeps all).
    unreachable = Settings(kafka={"bootstrap": f"127.0.0.1:{free_port()}"})  # type: ignore[arg-type]
    rec = Recorder(unreachable, Counting(tmp_path / "spool"), linger_s=linger_s)
    rec.start()
    try:
        for i in range(4):  # one every 20 ms: each alone in the queue when the writer looks
            rec.record("t", dataclasses.replace(examples.interaction(), event_id=f"e{i}"))
            time.sleep(0.02)
        assert _wait(lambda: sum(appends) == 4, 5.0), appends
    finally:
        rec.close(timeout=0.5)
    if linger_s:  # the first event waited for the other three
        assert appends == [4]
    else:  # nothing waits: a lone event is written at once (a slow fsync may pair two)
        assert len(appends) >= 2 and appends[0] == 1
