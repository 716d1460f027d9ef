"""Issue 11, gateway side: no single request can stop recording, and nothing is lost silently.

Each test first shows the failure the adversarial run found (where it can be shown without the
old code) and then the behaviour now: deep JSON refused before it is served, a bad event
dead-lettered while the rest flow on, lost events visible in health/metrics with 503 for turns
that would train, bounded header/body times, bounded session ids, aborted streams recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from click.testing import CliRunner
from confluent_kafka import Consumer, TopicPartition
from fastapi import FastAPI

from pipeline import events
from pipeline.events import examples
from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.build import build_app
from pipeline.serving.commands import serve, server_config
from pipeline.serving.recorder import Recorder, spooled_values
from pipeline.serving.settings import ServeSettings
from pipeline.serving.spool import Spool
from pipeline.serving.threaded import running
from pipeline.settings import Settings
from pipeline.stack import free_port

from .conftest import create_topic
from .test_serving_hf import FakeRecorder

MODEL = "liverl-tiny-v1"


def body(text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


def gateway_cfg(tmp_path: Path, **extra: Any) -> ServeSettings:
    return ServeSettings(
        model_path="tiny", spool_dir=tmp_path / "spool", reload=False, turn_recovery_s=0, **extra
    )


def nested(depth: int) -> Any:
    doc: Any = 1
    for _ in range(depth):
        doc = {"a": doc}
    return doc


def wait(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def consume_all(settings: Settings, topic: str, expected: int, timeout: float = 30) -> list[Any]:
    """Every event of a (fresh, one-partition) topic, waiting until ``expected`` arrived."""
    c = Consumer(settings.kafka_client_config(**{"group.id": f"verify-{topic}"}))
    c.assign([TopicPartition(topic, 0, 0)])
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < expected and time.monotonic() < deadline:
        for msg in c.consume(100, timeout=0.5):
            if msg.error() is None:
                got.append(events.decode(msg.value()))
    time.sleep(0.5)  # and nothing more after them
    got += [events.decode(m.value()) for m in c.consume(100, timeout=0.5) if m.error() is None]
    c.close()
    return got


@pytest.fixture(scope="module")
def tiny() -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), workers=2)


@pytest.fixture
def fake_served(tiny: HFBackend) -> Iterator[tuple[str, FakeRecorder]]:
    rec = FakeRecorder()
    with running(create_app(Gateway(ServeSettings(), tiny, rec))) as url:  # type: ignore[arg-type]
        yield url, rec


# ---- 1. deep JSON -------------------------------------------------------------------------


def test_deep_json_could_not_be_recorded() -> None:
    """The failure: 260 levels parse and could be served, but the event cannot be encoded."""
    deep = dataclasses.replace(
        examples.interaction(), messages=[{"role": "user", "content": "x", "meta": nested(260)}]
    )
    with pytest.raises(events.EventValidationError, match="[Rr]ecursion"):
        events.encode(deep)


def test_deep_json_is_400_and_limit_is_inclusive(fake_served: tuple[str, FakeRecorder]) -> None:
    url, rec = fake_served
    with httpx.Client(timeout=60) as c:
        msg = {"role": "user", "content": "x", "meta": nested(260)}
        r = c.post(f"{url}/v1/chat/completions", json={**body(), "messages": [msg]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "json_too_deep"
        # body(1) > messages(2) > message(3) > meta: 61 more levels reach the limit of 64
        msg["meta"] = nested(61)
        assert (
            c.post(f"{url}/v1/chat/completions", json={**body(), "messages": [msg]}).status_code
            == 200
        )
        msg["meta"] = nested(62)
        assert (
            c.post(f"{url}/v1/chat/completions", json={**body(), "messages": [msg]}).status_code
            == 400
        )
    assert len(rec.interactions()) == 1


@pytest.mark.integration
def test_deep_json_then_20_requests_all_recorded(
    kafka_settings: Settings, admin: Any, unique: str, tmp_path: Path
) -> None:
    topic = f"test.interactions.{unique}"
    create_topic(admin, topic)
    cfg = gateway_cfg(tmp_path, interactions_topic=topic)
    app = build_app(cfg, kafka_settings)
    with running(app) as url, httpx.Client(timeout=60) as c:
        deep = {"role": "user", "content": "x", "meta": nested(260)}
        r = c.post(f"{url}/v1/chat/completions", json={**body(), "messages": [deep]})
        assert r.status_code == 400, r.text
        for i in range(20):
            r = c.post(
                f"{url}/v1/chat/completions",
                json=body(f"q{i}"),
                headers={"X-Session-Id": f"s-{unique}"},
            )
            assert r.status_code == 200, r.text
        assert wait(lambda: app.state.recorder.backlog == 0, 30)
        assert c.get(f"{url}/healthz").json()["status"] == "ok"
    got = consume_all(kafka_settings, topic, 20)
    assert sorted(e.turn for e in got) == list(range(20)), "20/20 recorded, once each"


# ---- 1. the recorder survives any single bad event -----------------------------------------


@pytest.mark.integration
def test_recorder_dead_letters_a_bad_event_and_goes_on(
    kafka_settings: Settings, admin: Any, unique: str, tmp_path: Path
) -> None:
    topic, dlq = f"test.interactions.{unique}", f"test.dlq.{unique}"
    create_topic(admin, topic)
    create_topic(admin, dlq)
    settings = kafka_settings.model_copy(deep=True)
    settings.kafka.max_event_bytes = 200_000
    rec = Recorder(settings, Spool(tmp_path / "spool"), dlq_topic=dlq, delivery_timeout_s=5)
    rec.start()
    base = examples.interaction()
    unencodable = dataclasses.replace(
        base, event_id="bad-1", messages=[{"role": "user", "content": "x", "meta": nested(300)}]
    )
    oversized = dataclasses.replace(base, event_id="bad-2", response_text="y" * 300_000)
    good = [dataclasses.replace(base, event_id=f"good-{i}", turn=i) for i in range(3)]
    try:
        rec.record(topic, good[0])
        rec.record(topic, unencodable)
        rec.record(topic, oversized)
        rec.record(topic, good[1])
        assert wait(lambda: rec.backlog == 0, 30)
        assert rec.alive, "the writer thread survived"
        rec.record(topic, good[2])  # and still records afterwards
        assert wait(lambda: rec.backlog == 0, 30)
    finally:
        rec.close()
    assert [e.event_id for e in consume_all(settings, topic, 3)] == ["good-0", "good-1", "good-2"]
    letters = consume_all(settings, dlq, 2)
    assert len(letters) == 2 and rec.dead_lettered == 2
    by_error = {("encode" in ltr.error): ltr for ltr in letters}
    assert "Recursion" in by_error[True].error or "recursion" in by_error[True].error
    big = by_error[False]
    assert "exceeds the codec limit" in big.error and "sha256" in big.error
    assert len(big.original()) == 64 * 1024, "payload cut, size and hash kept"
    assert big.source_topic == topic and big.original_key() == base.session_id.encode()


# ---- 5. spool unwritable while Kafka is down -----------------------------------------------


def _dead_kafka() -> Settings:
    s = Settings()
    s.kafka.bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    return s


def _spooled_ids(spool: Spool) -> list[str]:
    frames, _cursor = spool.peek(spool.pending)
    return [events.decode(v).event_id for v in spooled_values(frames)]


def test_unwritable_spool_and_kafka_down_degrade_and_refuse(tmp_path: Path) -> None:
    """Issue 37: with Kafka down and the spool's disk full, the turns answered 200 before the
    first failed write (which only that write reveals) were dropped, because older spooled
    events waited; their clients had been told nothing. Now every answer says whether its
    turn is recorded (X-Liverl-Recorded: the event id, or empty); a turn answered as recorded
    is held until the disk is back, and events_lost counts exactly the turns answered as not
    recorded. Kafka down alone never fails a request: those turns are spooled."""
    cfg = gateway_cfg(tmp_path, delivery_timeout_s=1.0)
    app = build_app(cfg, _dead_kafka())
    rec: Recorder = app.state.recorder
    rec.probe_every_s = 0.2
    gw: Gateway = app.state.gateway

    def disk_full(*_a: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    answered: dict[str, str] = {}  # text -> X-Liverl-Recorded of each turn served 200
    with running(app) as url, httpx.Client(timeout=60) as c:
        chat, health = f"{url}/v1/chat/completions", f"{url}/healthz"

        def turn(text: str, **kw: Any) -> httpx.Response:
            r = c.post(chat, json=body(text, **kw), headers={"X-Session-Id": text})
            if r.status_code == 200:
                answered[text] = r.headers["x-liverl-recorded"]
            return r

        assert turn("spooled").status_code == 200  # Kafka down alone: spooled
        assert answered["spooled"], "answered as recorded"
        assert wait(lambda: c.get(health).json()["kafka_up"] is False, 10)
        assert c.get(health).status_code == 200

        rec.spool.append = disk_full  # type: ignore[method-assign]
        rec.spool.check = disk_full  # type: ignore[method-assign]
        assert turn("unseen").status_code == 200  # the disk's state is learnt after this
        assert answered["unseen"], "nothing was known to be wrong when it was answered"
        assert wait(lambda: c.get(health).status_code == 503, 10)
        state = c.get(health).json()
        assert state["status"] == "degraded" and "No space left" in state["reasons"][0]
        assert state["events_lost"] == 0 and state["record_held"] == 1, "held, not dropped"
        assert rec.backlog == 2

        r = turn("refused")
        assert r.status_code == 503 and r.json()["error"]["code"] == "recording_unavailable"
        not_recorded = turn("not trained", train=False)
        assert not_recorded.status_code == 200 and answered["not trained"] == ""

        gw.cfg.serve_without_training = True  # the explicit choice: serve, say it, count it
        assert turn("served unrecorded").status_code == 200
        assert answered["served unrecorded"] == ""
        with c.stream(
            "POST",
            chat,
            json=body("streamed unrecorded", stream=True),
            headers={"X-Session-Id": "streamed unrecorded"},
        ) as streamed:
            assert streamed.status_code == 200
            answered["streamed unrecorded"] = streamed.headers["x-liverl-recorded"]
            assert "[DONE]" in streamed.read().decode()
        assert answered["streamed unrecorded"] == ""
        assert wait(lambda: metric(url, "liverl_gateway_events_lost_total") == 2, 10)
        gw.cfg.serve_without_training = False
        assert rec.held == 1 and c.get(health).json()["events_lost"] == 2

        del rec.spool.append, rec.spool.check  # the disk has room again
        assert wait(lambda: c.get(health).status_code == 200, 10), c.get(health).text
        assert turn("back").status_code == 200 and answered["back"]
        assert wait(lambda: rec.spool.pending == 3, 10), "the held turn, then the new one"
        assert rec.held == 0 and c.get(health).json()["events_lost"] == 2
        stopping = time.monotonic()
    # shutdown is bounded with Kafka down and events pending (they stay in the spool)
    assert time.monotonic() - stopping < cfg.shutdown_timeout_s + 5
    # what is spooled is exactly what the answers said is recorded, in order; the turns
    # answered as not recorded (a trainable one among them) are exactly the ones counted lost
    recorded = [answered[t] for t in ("spooled", "unseen", "back")]
    assert _spooled_ids(rec.spool) == recorded
    assert rec.lost == 2 == sum(1 for t, h in answered.items() if not h and t != "not trained")


class FailsMidAnswer:
    """The tiny model; recording fails (the recorder's problem is set) while it answers."""

    def __init__(self, inner: HFBackend, rec: Recorder) -> None:
        self.inner, self.rec = inner, rec

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, prompt_ids: list[int], params: Any) -> Any:
        async for item in self.inner.generate(prompt_ids, params):
            self.rec.problem = "spool write failed: No space left on device; Kafka is unreachable"
            yield item


def test_an_answer_says_whether_its_turn_is_recorded(tiny: HFBackend, tmp_path: Path) -> None:
    """X-Liverl-Recorded is the turn's event id when the answer can say it is recorded, and
    the recorder is told so (it holds such an event rather than drop it); a JSON answer
    whose recording failed while it was generated says it is not, and so is the event
    handed over (counted lost if it cannot be stored); a stream's headers went out before."""
    rec = Recorder(_dead_kafka(), Spool(tmp_path / "spool"))  # not started: events stay queued
    gw = Gateway(ServeSettings(), FailsMidAnswer(tiny, rec), rec)  # type: ignore[arg-type]
    handed: list[tuple[str, bool]] = []

    def answer(c: httpx.Client, url: str, **extra: Any) -> str:
        rec.problem = None
        chat = f"{url}/v1/chat/completions"
        with c.stream("POST", chat, json=body(**extra)) as r:
            assert r.status_code == 200
            r.read()
        _topic, event, promised = rec._queue.get_nowait()
        handed.append((event.event_id, promised))
        return r.headers["x-liverl-recorded"]

    with running(create_app(gw)) as url, httpx.Client(timeout=60) as c:
        streamed = answer(c, url, stream=True)
        assert handed[-1] == (streamed, True)
        late = answer(c, url)
        assert late == "" and handed[-1][1] is False
        assert rec._queue.empty()
        r = c.post(f"{url}/v1/chat/completions", json=body(), headers={"X-Liverl-Train": "false"})
        assert r.status_code == 200 and r.headers["x-liverl-recorded"] == ""
        assert rec._queue.empty(), "not recorded at all"
    rec.spool.close()


@contextmanager
def own_broker(tmp_path: Path) -> Iterator[tuple[Settings, Any]]:
    """A broker of this test's own (it is taken down), with the interactions and DLQ topics."""
    from confluent_kafka.admin import AdminClient

    from pipeline.kafka import names, topics
    from pipeline.kafka.broker import LocalBroker
    from pipeline.settings import BrokerSettings

    settings = Settings(
        state_dir=tmp_path / "state",
        broker=BrokerSettings(port=free_port(), controller_port=free_port()),
    )
    settings.kafka.bootstrap = None  # its own broker, even when LIVERL_KAFKA_BOOTSTRAP is set
    local = LocalBroker(settings)
    try:
        local.up(quiet=True)
        admin = AdminClient(settings.kafka_client_config())
        specs = [
            s
            for s in topics.load_specs(settings.topics.specs_dir)
            if s.name in (names.INTERACTIONS, names.DLQ)
        ]
        topics.apply(admin, topics.plan(admin, specs))
        yield settings, local
    finally:
        local.down(quiet=True)


def _path_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


EPERM = PermissionError(errno.EPERM, "Operation not permitted")


@contextmanager
def broken_disk(
    spool: Spool, fail: Callable[[str, Any], bool], error: OSError = EPERM
) -> Iterator[None]:
    """Make the spool folder's disk fail (tests cannot ``chattr +i`` or fill a disk):
    ``os.write``/``fsync``/``ftruncate`` on a file in it, and ``os.open`` for writing there,
    raise ``error`` when ``fail(call, data)`` says so (``data``: a write's bytes, else None)."""
    inside = str(spool.dir.resolve()) + os.sep
    real = {name: getattr(os, name) for name in ("write", "fsync", "ftruncate", "open")}

    def on_fd(name: str) -> Callable[..., Any]:
        def call(fd: int, *args: Any) -> Any:
            data = args[0] if name == "write" else None
            if _path_of(fd).startswith(inside) and fail(name, data):
                raise error
            return real[name](fd, *args)

        return call

    def open_(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writing and str(Path(path).resolve()).startswith(inside) and fail("open", None):
            raise error
        return real["open"](path, flags, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        for name in ("write", "fsync", "ftruncate"):
            mp.setattr(os, name, on_fd(name))
        mp.setattr(os, "open", open_)
        yield


def immutable(spool: Spool) -> Any:
    """What ``chattr -R +i`` on the spool folder does: every write there fails (EPERM)."""
    return broken_disk(spool, lambda _call, _data: True)


@pytest.mark.integration
def test_a_spool_error_does_not_stick(tmp_path: Path) -> None:
    """Issue 25: with Kafka down, a spool made immutable tore its tail; after the disk was
    fixed ``/healthz`` said ok but the spool stayed broken (``spool_error`` "...is torn"),
    so with Kafka down again the next training turns were answered 200 and lost. Now the
    spool is re-probed and repaired once the disk is back: the error clears and turns are
    spooled, then delivered; while it is broken, training turns are refused, never lost
    after a 200. The turn that revealed the broken disk was answered as recorded before
    anything was known: it is held and delivered too (issue 37: it used to be lost)."""
    from confluent_kafka.admin import AdminClient

    with own_broker(tmp_path) as (settings, local):
        topic = "test.interactions.one"
        create_topic(AdminClient(settings.kafka_client_config()), topic)
        cfg = gateway_cfg(tmp_path, delivery_timeout_s=3.0, interactions_topic=topic)
        app = build_app(cfg, settings)
        rec: Recorder = app.state.recorder
        rec.probe_every_s = 0.2
        with running(app) as url, httpx.Client(timeout=60) as c:
            chat, health = f"{url}/v1/chat/completions", f"{url}/healthz"

            def turn(text: str) -> httpx.Response:
                return c.post(chat, json=body(text), headers={"X-Session-Id": text})

            assert turn("before").status_code == 200
            assert wait(lambda: rec.backlog == 0, 30)
            local.down(quiet=True)
            assert wait(lambda: c.get(health).json()["kafka_up"] is False, 10)

            with immutable(rec.spool):
                unseen = turn("unseen")  # the disk's state is learnt after this answer
                assert unseen.status_code == 200 and unseen.headers["x-liverl-recorded"]
                assert wait(lambda: c.get(health).status_code == 503, 10)
                state = c.get(health).json()
                assert state["events_lost"] == 0 and rec.held == 1
                assert "Operation not permitted" in state["spool_error"]
                assert rec.spool.broken is not None and "is torn" in rec.spool.broken
                refused = turn("refused")
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "recording_unavailable"
                assert refused.headers["retry-after"] == "5"
            # the disk is back, Kafka still down: the spool repairs itself, nothing sticks
            assert wait(lambda: c.get(health).status_code == 200, 10), c.get(health).text
            state = c.get(health).json()
            assert state["status"] == "ok" and state["spool_error"] is None
            assert rec.spool.broken is None
            assert [turn(f"kept-{i}").status_code for i in range(2)] == [200, 200]
            assert wait(lambda: rec.spool.pending == 3, 10), "spooled, not lost"
            assert c.get(health).json()["events_lost"] == 0
            local.up(quiet=True)
            assert wait(lambda: rec.backlog == 0, 60)
        got = consume_all(settings, topic, 4)
        assert sorted(e.session_id for e in got) == ["before", "kept-0", "kept-1", "unseen"]
        assert unseen.headers["x-liverl-recorded"] in {e.event_id for e in got}


@pytest.mark.integration
def test_training_turns_are_refused_while_the_spool_is_broken_even_with_kafka_up(
    kafka_settings: Settings, admin: Any, unique: str, tmp_path: Path
) -> None:
    """With no spool a turn reaches Kafka only if Kafka stays up until it is delivered, and
    the gateway learns that Kafka went down only after it did (the lost turns of issue 25):
    while the spool cannot be written, turns that would train are refused (503) whatever
    Kafka's state; ones that would not train are served, and the error clears on repair."""
    topic = f"test.interactions.{unique}"
    create_topic(admin, topic)
    app = build_app(gateway_cfg(tmp_path, interactions_topic=topic), kafka_settings)
    rec: Recorder = app.state.recorder
    rec.probe_every_s = 0.2
    with running(app) as url, httpx.Client(timeout=60) as c:
        chat, health = f"{url}/v1/chat/completions", f"{url}/healthz"
        with immutable(rec.spool):
            assert c.post(chat, json=body("first")).status_code == 200  # learnt here
            assert wait(lambda: c.get(health).status_code == 503, 10)
            state = c.get(health).json()
            assert state["kafka_up"] is True and state["events_lost"] == 0  # produced directly
            assert "unspooled" in state["reasons"][0]
            r = c.post(chat, json=body("second"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "recording_unavailable"
            assert c.post(chat, json=body(), headers={"X-Liverl-Train": "false"}).status_code == 200
        assert wait(lambda: c.get(health).status_code == 200, 10)
        assert c.post(chat, json=body("third")).status_code == 200
        assert wait(lambda: rec.backlog == 0, 30)
    got = consume_all(kafka_settings, topic, 2)
    assert [e.messages[-1]["content"] for e in got] == ["first", "third"]


def test_health_stays_degraded_while_events_are_lost_serving_without_training(
    tmp_path: Path,
) -> None:
    """Issue 25: with --serve-without-training a disk with room for the probe's few bytes but
    not for the records passed the probe, so ``/healthz`` said ok between turns that were all
    lost. The probe now writes as much as the append that failed: health stays degraded
    while events are lost, serving goes on, and ok returns once the disk has room. Issue 37:
    the first turn, answered as recorded before the failure was known, is held (it used to
    be lost), the later ones are answered as not recorded (X-Liverl-Recorded empty) and
    counted lost."""
    cfg = gateway_cfg(tmp_path, delivery_timeout_s=1.0, serve_without_training=True)
    app = build_app(cfg, _dead_kafka())
    rec: Recorder = app.state.recorder
    rec.probe_every_s = 0.1
    full = OSError(errno.ENOSPC, "No space left on device")
    with running(app) as url, httpx.Client(timeout=60) as c:
        chat, health = f"{url}/v1/chat/completions", f"{url}/healthz"
        assert wait(lambda: c.get(health).json()["kafka_up"] is False, 10)
        with broken_disk(rec.spool, lambda call, data: call == "write" and len(data) > 64, full):
            for i in range(3):
                r = c.post(chat, json=body(f"lost {i}"))
                assert r.status_code == 200  # served
                assert bool(r.headers["x-liverl-recorded"]) is (i == 0)  # nothing known yet
                assert wait(lambda n=i: rec.lost == n and rec.held == 1, 10)  # type: ignore[misc]
                time.sleep(0.5)  # several probes
                state = c.get(health)
                assert state.status_code == 503, state.text
                assert state.json()["status"] == "degraded"
                assert "No space left" in state.json()["reasons"][0]
        assert wait(lambda: c.get(health).status_code == 200, 10)
        assert c.post(chat, json=body("kept")).status_code == 200
        assert wait(lambda: rec.spool.pending == 2, 10) and rec.lost == 2 and rec.held == 0


@pytest.mark.integration
def test_health_reports_kafka_down_within_the_delivery_timeout(tmp_path: Path) -> None:
    with own_broker(tmp_path) as (settings, local):
        cfg = gateway_cfg(tmp_path, delivery_timeout_s=8.0)
        app = build_app(cfg, settings)
        with running(app) as url, httpx.Client(timeout=60) as c:
            assert c.post(f"{url}/v1/chat/completions", json=body()).status_code == 200
            assert wait(lambda: app.state.recorder.backlog == 0, 30)
            assert c.get(f"{url}/healthz").json()["kafka_up"] is True
            local.down(quiet=True)
            down_at = time.monotonic()
            assert wait(lambda: c.get(f"{url}/healthz").json()["kafka_up"] is False, 8.0)
            detected_s = time.monotonic() - down_at
            # Kafka down alone loses nothing (the spool holds it): health stays ok
            assert c.get(f"{url}/healthz").json()["status"] == "ok"
        print(f"kafka down detected after {detected_s:.1f}s")


# ---- 7. bounded header values ------------------------------------------------------------


def test_session_header_length_and_utf8(fake_served: tuple[str, FakeRecorder]) -> None:
    url, rec = fake_served
    chat = f"{url}/v1/chat/completions"
    with httpx.Client(timeout=60) as c:
        r = c.post(chat, json=body(), headers={"X-Session-Id": "a" * 257})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-Id"
        r = c.post(chat, json=body(), headers={"X-Session-Id": b"bad-\xff\xfe"})
        assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
        r = c.post(chat, json=body(), headers={"X-Liverl-Group": "g" * 300})
        assert r.status_code == 400
        assert c.post(chat, json=body(), headers={"X-Session-Id": "a" * 256}).status_code == 200
        r = c.post(chat, json=body(), headers={"X-Session-Id": "café".encode()})
        assert r.status_code == 200
    assert [i.session_id for i in rec.interactions()] == ["a" * 256, "café"]  # not mojibake


# ---- 7. slow headers and bodies ----------------------------------------------------------


@contextmanager
def served_with_timeouts(app: FastAPI, cfg: ServeSettings, **overrides: Any) -> Iterator[int]:
    port = free_port()
    server = uvicorn.Server(server_config(app, cfg, port=port, log_level="warning", **overrides))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait(lambda: server.started, 60)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def dribble(port: int, head: bytes, drip: bytes, seconds: float) -> tuple[float | None, bytes]:
    """Send ``head`` then ``drip`` every 0.1 s; when the server closed the connection (None:
    still open after ``seconds``) and what it answered."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head)
    start, got = time.monotonic(), b""
    try:
        while time.monotonic() - start < seconds:
            ready, _, _ = select.select([sock], [], [], 0.1)
            if ready:
                try:
                    data = sock.recv(65536)
                except OSError:  # reset by the server
                    data = b""
                if not data:
                    return time.monotonic() - start, got
                got += data
                continue
            try:
                sock.sendall(drip)
            except OSError:
                return time.monotonic() - start, got
        return None, got
    finally:
        sock.close()


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
BODY_HEAD = HEAD + b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"


def test_slow_headers_stay_open_without_the_timeout(tiny: HFBackend) -> None:
    """The failure: uvicorn's defaults keep a connection dribbling headers open."""
    with running(create_app(Gateway(ServeSettings(), tiny, FakeRecorder()))) as url:  # type: ignore[arg-type]
        port = int(url.rsplit(":", 1)[1])
        closed, _ = dribble(port, HEAD, b"X-A: b\r\n", 2.0)
    assert closed is None


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_slow_headers_and_bodies_are_closed(tiny: HFBackend, parser: str) -> None:
    """Both header-timeout protocols: httptools (production) and the h11 fallback."""
    from pipeline.serving.commands import _h11_header_timeout

    cfg = ServeSettings(header_timeout_s=1.0, body_timeout_s=1.5)
    fallback = {"http": _h11_header_timeout(cfg.header_timeout_s)} if parser == "h11" else {}
    app = create_app(Gateway(cfg, tiny, FakeRecorder()))  # type: ignore[arg-type]
    results: list[tuple[str, float | None, bytes]] = []

    def one(kind: str, port: int) -> None:
        head, drip = (HEAD, b"X-A: b\r\n") if kind == "header" else (BODY_HEAD, b" ")
        results.append((kind, *dribble(port, head, drip, 8.0)))

    with served_with_timeouts(app, cfg, **fallback) as port:
        threads = [
            threading.Thread(target=one, args=(k, port))
            for k in ("header", "body")
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # and the server still answers normally
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body(), timeout=60)
        assert r.status_code == 200
    for kind, closed, answer in results:
        assert closed is not None, f"{kind} dribbler still open after 8 s"
        if kind == "header":
            assert closed < 3.0
        else:
            assert closed < 4.0 and answer.startswith(b"HTTP/1.1 408"), answer[:200]


# ---- 7. a client that leaves mid-stream ----------------------------------------------------


class SlowBackend:
    """The tiny model at one token per 50 ms, so a client can leave mid-answer."""

    def __init__(self, inner: HFBackend) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, prompt_ids: list[int], params: Any) -> Any:
        async for item in self.inner.generate(prompt_ids, params):
            await asyncio.sleep(0.05)
            yield item


def test_midstream_disconnect_is_recorded_as_aborted(tiny: HFBackend) -> None:
    rec = FakeRecorder()
    gw = Gateway(ServeSettings(), SlowBackend(tiny), rec)  # type: ignore[arg-type]
    with running(create_app(gw)) as url, httpx.Client(timeout=60) as c:
        chat = f"{url}/v1/chat/completions"
        req = body(max_tokens=400, stream=True, seed=3)
        headers = {"X-Session-Id": "leaver"}
        with c.stream("POST", chat, json=req, headers=headers) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
        assert any("content" in ln for ln in got)
        assert wait(lambda: bool(rec.interactions()), 10), "the partial turn is recorded"
        aborted = rec.interactions()[0]
        assert aborted.finish_reason == "abort" and aborted.train is False
        assert aborted.turn == 0 and 0 < len(aborted.response_token_ids) < 400
        assert len(aborted.response_logprobs) == len(aborted.response_token_ids)
        retry = c.post(chat, json=body(), headers=headers)
        assert retry.headers["x-liverl-turn"] == "1", "the retry is the next turn"
        assert metric(url, "liverl_gateway_turns_aborted_total") == 1


# ---- 7. unwritable state dir at start-up ---------------------------------------------------


def test_unwritable_spool_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    spool = blocker / "spool"
    result = CliRunner().invoke(serve, ["--spool-dir", str(spool)], obj={"settings": Settings()})
    assert result.exit_code == 1
    assert str(spool) in result.output and "not writable" in result.output
    assert "Traceback" not in result.output
