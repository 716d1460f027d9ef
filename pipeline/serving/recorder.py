"""Asynchronous event recording: request path -> memory queue -> fsynced spool -> Kafka.

``record()`` never blocks on disk or Kafka. A writer thread appends batches to the spool (one
fsync per batch); a drainer thread sends spooled records in order and acknowledges them in the
spool only after Kafka confirmed every one. A record whose delivery failed (broker down past
the delivery timeout) is sent again with a fresh producer, later records waiting behind it, so
order is kept and a record is re-sent only when Kafka reported it failed. Consumers still
deduplicate by ``event_id`` for the crash window between delivery and the spool ack.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any

import orjson
from confluent_kafka import KafkaError, Message

from pipeline import events
from pipeline.kafka import DeliveryError, EventProducer
from pipeline.settings import Settings

from .spool import Spool

log = logging.getLogger(__name__)


class Recorder:
    def __init__(
        self,
        kafka: Settings,
        spool: Spool,
        *,
        delivery_timeout_s: float = 15.0,
        batch: int = 500,
        client_id: str = "liverl-gateway",
    ) -> None:
        self.kafka = kafka
        self.spool = spool
        self.delivery_timeout_s = delivery_timeout_s
        self.batch = batch
        self.client_id = client_id
        self.delivered = 0
        self.redelivered = 0
        self.kafka_up = True
        self._queue: queue.Queue[tuple[str, events.Event] | None] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="spool-writer", daemon=True)
        self._drainer = threading.Thread(target=self._drain_loop, name="spool-drain", daemon=True)
        self._producer: EventProducer | None = None

    # ---- API ----------------------------------------------------------------------------

    def start(self) -> None:
        self._writer.start()
        self._drainer.start()

    def record(self, topic: str, event: events.Event) -> None:
        """Hand an event over; returns at once."""
        self._queue.put((topic, event))

    @property
    def backlog(self) -> int:
        """Events not yet confirmed by Kafka (in memory or in the spool)."""
        return self._queue.qsize() + self.spool.pending

    def close(self, timeout: float = 10.0) -> None:
        """Spool everything queued, try to deliver for up to ``timeout``, then stop."""
        self._queue.put(None)
        self._writer.join()
        deadline = time.monotonic() + timeout
        while self.spool.pending and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self._drainer.join(timeout=self.delivery_timeout_s + 5)
        self._reset_producer()  # free the librdkafka handle now, not whenever GC runs
        self.spool.close()

    # ---- threads ------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            items = [item]
            while len(items) < self.batch:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            done = None in items
            payloads = [_frame(topic, ev) for it in items if it is not None for topic, ev in [it]]
            try:
                self.spool.append(payloads)
            except OSError:
                log.exception("spool write failed; %d event(s) lost", len(payloads))
            self._wake.set()
            if done:
                return

    def _drain_loop(self) -> None:
        while not self._stop.is_set():
            try:
                records, cursor = self.spool.peek(self.batch)
            except OSError:
                log.exception("spool read failed")
                self._stop.wait(1.0)
                continue
            if not records:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            if self._deliver(records):
                self.spool.ack(cursor)

    def _deliver(self, records: list[bytes]) -> bool:
        """Send every record until each is confirmed; False only when stopping."""
        status: list[bool | None] = [False] * len(records)  # False: to send, None: in flight
        first = True
        while not all(s is True for s in status):
            if self._stop.is_set():
                return False
            producer = self._get_producer()
            for i, raw in enumerate(records):
                if status[i] is False:
                    if not first:
                        self.redelivered += 1
                    status[i] = None
                    topic, key, value, hdrs = unframe(raw)
                    producer.send_raw(
                        topic, value, key=key, headers=hdrs, on_delivery=_mark(status, i)
                    )
            first = False
            while any(s is None for s in status):
                producer.poll(0.2)
            failed = status.count(False)
            self.kafka_up = failed == 0
            if failed:
                log.warning("%d event(s) not delivered; Kafka unreachable? retrying", failed)
                self._reset_producer()
                self._stop.wait(0.5)
        self.delivered += len(records)
        return True

    def _get_producer(self) -> EventProducer:
        if self._producer is None:
            self._producer = EventProducer(
                self.kafka,
                client_id=self.client_id,
                **{"message.timeout.ms": int(self.delivery_timeout_s * 1000)},
            )
        return self._producer

    def _reset_producer(self) -> None:
        if self._producer is not None:
            with contextlib.suppress(DeliveryError):  # failures were recorded per record
                self._producer.flush(0)
            self._producer = None


def _mark(status: list[bool | None], i: int) -> Any:
    def report(err: KafkaError | None, _msg: Message) -> None:
        status[i] = err is None

    return report


def _frame(topic: str, event: events.Event) -> bytes:
    value = events.encode(event)
    key = events.key(event)
    return orjson.dumps(
        {
            "t": topic,
            "k": None if key is None else key.decode(),
            "h": [[k, v.decode()] for k, v in events.headers(event)],
            "v": value.decode(),
        }
    )


def unframe(raw: bytes) -> tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]:
    doc = orjson.loads(raw)
    hdrs = [(k, v.encode()) for k, v in doc["h"]]
    return doc["t"], None if doc["k"] is None else doc["k"].encode(), doc["v"].encode(), hdrs
