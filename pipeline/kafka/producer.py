"""Idempotent event producer: acks=all, compression, delivery errors surfaced, never silent."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from pipeline import events
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable, connection_of
from pipeline.kafka.errors import DeliveryError, DeliveryFailure

log = logging.getLogger(__name__)

DeliveryCallback = Callable[[KafkaError | None, Message], None]


LIBRDKAFKA_LOG = logging.getLogger("pipeline.kafka.librdkafka")


class EventProducer:
    """Thin typed wrapper over confluent-kafka's Producer.

    Idempotence (``enable.idempotence``) gives acks=all and per-partition ordering without
    duplicates on retry. Failures from delivery reports are collected and raised by
    :meth:`flush`, so a caller that flushes cannot miss a lost record. Topics are live names;
    with ``kafka.namespace`` set they are sent to the namespace's copies (``names.resolve``).
    """

    def __init__(
        self,
        connection: Connectable,
        *,
        client_id: str = "liverl",
        transactional_id: str | None = None,
        **extra: Any,
    ) -> None:
        kafka = connection_of(connection)
        conf = kafka.client_config(
            **{
                "client.id": client_id,
                "enable.idempotence": True,
                "acks": "all",
                "compression.type": kafka.compression,
                "linger.ms": 5,
                # Java clients and Faust/aiokafka hash keys with murmur2; librdkafka's default
                # (CRC32) would put one session on different partitions in different topics
                # and break co-partitioned joins.
                "partitioner": "murmur2_random",
                # The size policy (KafkaSettings): an event of max_event_bytes plus key and
                # headers always fits; the broker and every topic accept the same size.
                "message.max.bytes": kafka.max_record_bytes,
                "error_cb": self._on_client_error,
                # librdkafka's own log lines through Python logging, served by poll/flush:
                # not raw stderr lines, and none from a producer nobody polls any more (one
                # left to the garbage collector would print every reconnect attempt).
                "logger": LIBRDKAFKA_LOG,
            }
        )
        if transactional_id:
            conf["transactional.id"] = transactional_id
        conf.update(extra)
        self._producer = Producer(conf)
        self._max_event_bytes = kafka.max_event_bytes
        self.codec_version = kafka.codec_version
        self.namespace = kafka.namespace
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
        """Encode and produce; the key defaults to the one topics/*.yaml names for the event
        (:func:`pipeline.events.key`: the session, so topics stay co-partitioned; a serving
        status's replica; a dead letter's original key)."""
        if key is None:
            key = events.key(event)
        if isinstance(event, events.DeadLetter):
            # Whoever built it, a dead letter must fit the codec limit (base64 grows a 7 MB
            # record past the broker's limit: the produce error crash-looped its consumer).
            event = bound_dead_letter(event, self._max_event_bytes)
            if key is not None and len(key) > DLQ_KEY_BYTES:
                key = (key.encode() if isinstance(key, str) else key)[:DLQ_KEY_BYTES]
        self.send_raw(
            topic,
            events.encode(event, validate=validate, version=self.codec_version),
            key=key,
            headers=events.headers(event, version=self.codec_version),
            on_delivery=on_delivery,
        )

    def send_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: str | bytes | None = None,
        headers: Sequence[tuple[str, bytes | None]] | None = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> None:
        def report(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                self.delivered += 1
            else:
                with self._lock:
                    failure = DeliveryFailure(msg.topic() or topic, msg.key(), str(err))
                    self._failures.append(failure)
                log.error("delivery to %s failed: %s", msg.topic(), err)
            if on_delivery is not None:
                on_delivery(err, msg)

        kbytes = key.encode() if isinstance(key, str) else key
        if self.namespace:
            topic = names.resolve(topic, self.namespace)
        while True:
            try:
                self._producer.produce(
                    topic,
                    value=value,
                    key=kbytes,
                    headers=None if headers is None else list(headers),
                    on_delivery=report,
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


# Dead letters: the original key and headers are kept up to these sizes; beyond them only their
# size and hash are (a record's key can be nearly as large as the record itself).
DLQ_KEY_BYTES = 64 * 1024
DLQ_HEADER_BYTES = 64 * 1024
DLQ_ERROR_CHARS = 4096
# original_headers entries added when a dead letter had to be cut down to the codec limit.
TRUNCATED = "liverl-dlq-truncated"
ORIGINAL_BYTES = "liverl-dlq-original-bytes"
ORIGINAL_SHA256 = "liverl-dlq-original-sha256"


def bound_dead_letter(letter: events.DeadLetter, limit: int) -> events.DeadLetter:
    """``letter`` if it encodes within ``limit`` bytes, else a copy whose payload is cut.

    The copy keeps the source topic/partition/offset (the record can be re-read while it is
    retained), the original value's size and sha256 (in ``original_headers`` and the error),
    and as many leading payload bytes as fit. Oversized keys and headers are cut likewise.
    """
    if len(events.encode(letter)) <= limit:
        return letter
    original = letter.original()
    key = letter.original_key()
    notes = {
        TRUNCATED: "true",
        ORIGINAL_BYTES: str(len(original)),
        ORIGINAL_SHA256: hashlib.sha256(original).hexdigest(),
    }
    headers = dict(letter.original_headers)
    if sum(len(k) + len(v) for k, v in headers.items()) > DLQ_HEADER_BYTES:
        notes["liverl-dlq-original-header-count"] = str(len(headers))
        headers = {}
    if key is not None and len(key) > DLQ_KEY_BYTES:
        notes["liverl-dlq-original-key-bytes"] = str(len(key))
        notes["liverl-dlq-original-key-sha256"] = hashlib.sha256(key).hexdigest()
        key = key[:DLQ_KEY_BYTES]
    error = letter.error[:DLQ_ERROR_CHARS]

    def build(keep: int) -> events.DeadLetter:
        note = (
            f" [dead letter truncated to {keep} of {len(original)} bytes; "
            f"sha256 {notes[ORIGINAL_SHA256]}]"
        )
        return dataclasses.replace(
            letter,
            error=error + note,
            original_b64=base64.b64encode(original[:keep]).decode("ascii"),
            original_key_b64=None if key is None else base64.b64encode(key).decode("ascii"),
            original_headers={**headers, **notes},
        )

    # Base64 takes 4 bytes per 3; the empty-payload letter's size is what is left over.
    spare = limit - len(events.encode(build(len(original)))) + len(base64.b64encode(original))
    keep = max(0, min(len(original) - 1, spare // 4 * 3))
    out = build(keep)
    while len(events.encode(out)) > limit and keep > 0:  # never taken unless JSON escapes
        keep = max(0, keep - max(3, (len(events.encode(out)) - limit) // 4 * 3 + 3))
        out = build(keep)
    return out
