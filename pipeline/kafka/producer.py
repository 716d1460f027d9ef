"""Idempotent event producer: acks=all, compression, delivery errors surfaced, never silent."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from pipeline import events
from pipeline.settings import Settings

log = logging.getLogger(__name__)

DeliveryCallback = Callable[[KafkaError | None, Message], None]


class DeliveryError(RuntimeError):
    """One or more records were not acknowledged by the cluster."""

    def __init__(self, failures: list[DeliveryFailure]) -> None:
        self.failures = failures
        shown = "; ".join(f"{f.topic}: {f.error}" for f in failures[:5])
        more = f" (+{len(failures) - 5} more)" if len(failures) > 5 else ""
        super().__init__(f"{len(failures)} record(s) not delivered: {shown}{more}")


@dataclass(frozen=True)
class DeliveryFailure:
    topic: str
    key: bytes | None
    error: str


class EventProducer:
    """Thin typed wrapper over confluent-kafka's Producer.

    Idempotence (``enable.idempotence``) gives acks=all and per-partition ordering without
    duplicates on retry. Failures from delivery reports are collected and raised by
    :meth:`flush`, so a caller that flushes cannot miss a lost record.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        client_id: str = "liverl",
        transactional_id: str | None = None,
        **extra: Any,
    ) -> None:
        conf = settings.kafka_client_config(
            **{
                "client.id": client_id,
                "enable.idempotence": True,
                "acks": "all",
                "compression.type": settings.kafka.compression,
                "linger.ms": 5,
                # Java clients and Faust/aiokafka hash keys with murmur2; librdkafka's default
                # (CRC32) would put one session on different partitions in different topics
                # and break co-partitioned joins.
                "partitioner": "murmur2_random",
                "message.max.bytes": settings.kafka.max_event_bytes + 64 * 1024,
                "error_cb": self._on_client_error,
            }
        )
        if transactional_id:
            conf["transactional.id"] = transactional_id
        conf.update(extra)
        self._producer = Producer(conf)
        self._failures: list[DeliveryFailure] = []
        self._lock = threading.Lock()
        self.delivered = 0

    @property
    def raw(self) -> Producer:
        return self._producer

    def send(
        self,
        topic: str,
        event: events.Event,
        *,
        key: str | bytes | None = None,
        on_delivery: DeliveryCallback | None = None,
        validate: bool = False,
    ) -> None:
        """Encode and produce; the key defaults to the event's session (co-partitioning)."""
        if key is None:
            key = getattr(event, "session_id", None) or getattr(event, "policy_id", None)
        self.send_raw(
            topic,
            events.encode(event, validate=validate),
            key=key,
            headers=events.headers(event),
            on_delivery=on_delivery,
        )

    def send_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: str | bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> None:
        def report(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                self.delivered += 1
            else:
                with self._lock:
                    self._failures.append(DeliveryFailure(msg.topic(), msg.key(), str(err)))
                log.error("delivery to %s failed: %s", msg.topic(), err)
            if on_delivery is not None:
                on_delivery(err, msg)

        kbytes = key.encode() if isinstance(key, str) else key
        while True:
            try:
                self._producer.produce(
                    topic, value=value, key=kbytes, headers=headers, on_delivery=report
                )
                break
            except BufferError:
                # Local queue full: serve delivery reports to make room, then retry.
                self._producer.poll(0.1)
        self._producer.poll(0)

    def poll(self, timeout: float = 0.0) -> int:
        return self._producer.poll(timeout)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for every outstanding record; raise :class:`DeliveryError` on any failure."""
        remaining = self._producer.flush(timeout)
        with self._lock:
            failures, self._failures = self._failures, []
        if remaining:
            failures.append(
                DeliveryFailure("*", None, f"{remaining} record(s) still queued after {timeout}s")
            )
        if failures:
            raise DeliveryError(failures)

    def __len__(self) -> int:
        return len(self._producer)

    @staticmethod
    def _on_client_error(err: KafkaError) -> None:
        if err.fatal():
            log.error("fatal producer error: %s", err)
        else:
            log.debug("producer: %s", err)
