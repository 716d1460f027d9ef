"""Issue 37, item 2: an event whose answer said it is recorded is never dropped silently.

The gateway learns that the spool's disk is full from the first append that fails, after the
turns in that batch were answered 200. That batch used to be counted lost at once when older
spooled events waited for Kafka (order) or when the direct produce failed. Now an event
handed over while recording looked sound (``promised``) is held in memory and written, or
produced, once the spool or Kafka takes it; one handed over after the failure was known (its
answer said it may not be recorded) is counted lost at once. No broker here: Kafka is a
closed port, or a scripted direct producer.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import DeliveryError
from pipeline.kafka.errors import DeliveryFailure
from pipeline.serving.recorder import Recorder, spooled_values
from pipeline.serving.spool import Spool
from pipeline.settings import Settings
from pipeline.stack import free_port

TOPIC = "test.recorder.hold"


def wait(cond: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def dead_kafka() -> Settings:
    s = Settings()
    s.kafka.bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    return s


def disk_full(*_a: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def spooled_ids(spool: Spool) -> list[str]:
    frames, _cursor = spool.peek(spool.pending)
    return [events.decode(v).event_id for v in spooled_values(frames)]


@pytest.fixture
def recorder(tmp_path: Path) -> Iterator[Recorder]:
    rec = Recorder(dead_kafka(), Spool(tmp_path / "spool"), delivery_timeout_s=30,
                   probe_every_s=0.1)  # fmt: skip
    yield rec
    rec.close(timeout=0.5)


def test_a_failed_batch_is_held_while_older_spooled_events_wait(recorder: Recorder) -> None:
    rec = recorder
    rec.start()
    first = examples.interaction()
    rec.record(TOPIC, first)  # Kafka down: spooled, and waits there
    assert wait(lambda: rec.spool.pending == 1)

    rec.spool.append = disk_full  # type: ignore[method-assign]
    rec.spool.check = disk_full  # type: ignore[method-assign]
    promised = [examples.interaction() for _ in range(3)]  # answered before anything failed
    for ev in promised:
        rec.record(TOPIC, ev, promised=True)
    assert wait(lambda: rec.problem is not None)
    assert wait(lambda: rec.held == 3)
    assert rec.lost == 0, "the batch that failed was answered as recorded: held, not dropped"
    assert "No space left" in (rec.problem or "") and rec.backlog == 4

    for _ in range(2):  # the failure is known now (the default): answered as not recorded
        rec.record(TOPIC, examples.interaction())
    assert wait(lambda: rec.lost == 2)
    assert rec.held == 3

    del rec.spool.append, rec.spool.check  # the disk has room again
    assert wait(lambda: rec.held == 0 and rec.spool.pending == 4)
    assert rec.problem is None and rec.lost == 2 and rec.backlog == 4
    assert spooled_ids(rec.spool) == [first.event_id] + [ev.event_id for ev in promised]


def test_held_events_are_counted_lost_when_the_recorder_stops(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing else will try them: counted (events_lost) and logged as answered recorded."""
    rec = recorder
    lost: list[int] = []
    rec.on_lost = lost.append
    rec.start()
    rec.record(TOPIC, examples.interaction())
    assert wait(lambda: rec.spool.pending == 1)
    rec.spool.append = disk_full  # type: ignore[method-assign]
    rec.spool.check = disk_full  # type: ignore[method-assign]
    rec.record(TOPIC, examples.interaction(), promised=True)
    rec.record(TOPIC, examples.interaction(), promised=True)
    assert wait(lambda: rec.held == 2) and rec.lost == 0
    with caplog.at_level(logging.ERROR, logger="pipeline.serving.recorder"):
        rec.close(timeout=0.5)
    assert rec.lost == 2 == sum(lost) and rec.held == 0
    assert any("2 event(s) LOST" in r.getMessage() and "answered as recorded" in r.getMessage()
               for r in caplog.records)  # fmt: skip


class Direct:
    """The direct producer (used while the spool cannot be written and nothing is spooled):
    every record of a failing one is reported undelivered, as after a delivery timeout."""

    def __init__(self, fail: bool, sent: list[bytes]) -> None:
        self.fail, self.sent = fail, sent
        self.reports: list[tuple[Any, bytes]] = []

    def send_raw(self, topic: str, value: bytes, *, on_delivery: Any = None, **_kw: Any) -> None:
        self.reports.append((on_delivery, value))

    def flush(self, timeout: float) -> None:
        err = KafkaError(KafkaError._MSG_TIMED_OUT) if self.fail else None
        for report, value in self.reports:
            report(err, None)
            if not self.fail:
                self.sent.append(value)
        if self.fail:
            raise DeliveryError([DeliveryFailure(TOPIC, None, str(err))] * len(self.reports))


def test_a_batch_the_direct_produce_failed_is_held_and_sent_again(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = recorder
    sent: list[bytes] = []
    producers = iter([Direct(True, sent), Direct(True, sent), Direct(False, sent)])
    monkeypatch.setattr(rec, "_new_producer", lambda *_a, **_k: next(producers))
    monkeypatch.setattr(rec, "_probe", lambda: None)  # Kafka is "up" until a produce fails
    rec.spool.append = disk_full  # type: ignore[method-assign]
    rec.spool.check = disk_full  # type: ignore[method-assign]
    rec.start()
    promised = [examples.interaction() for _ in range(2)]
    for ev in promised:
        rec.record(TOPIC, ev, promised=True)
    assert wait(lambda: rec.held == 2 and not rec.kafka_up)
    assert rec.lost == 0, "Kafka did not take them, but their answers said recorded: held"
    rec.record(TOPIC, examples.interaction())  # answered as not recorded: lost at once
    assert wait(lambda: rec.lost == 1) and rec.held == 2

    rec.kafka_up = True  # as the drainer's probe finds it: the held ones go (one more failure)
    assert wait(lambda: not rec.kafka_up and rec.held == 2)
    rec.kafka_up = True
    assert wait(lambda: rec.held == 0)
    assert [events.decode(v).event_id for v in sent] == [ev.event_id for ev in promised]
    assert rec.lost == 1 and rec.delivered == 2 and rec.backlog == 0
    assert "unspooled" in (rec.problem or "")
