"""Recover per-session turn counters from the log when a gateway starts.

A turn's number is its conversation position, floored by the last number this replica gave
the session (``sessions.py``). The floor matters for clients whose requests do not carry the
history: a gateway that restarted mid-session would otherwise record a second "turn 0". The
interactions topic (and the local spool, for events Kafka has not acknowledged yet) already
says which turns each open session has used, so the floors are rebuilt from there: the log is
the source of truth. The same interactions say who owns each session (the ``user_id`` of its
first one there, closed sessions included: feedback on their turns still comes), so a restarted
gateway keeps refusing other users' posts for them (``sessions.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError, TopicPartition

from pipeline.kafka.connection import Connectable, connection_of

from .kafka_log import GATEWAY_KAFKA_LOG

log = logging.getLogger(__name__)


class TurnLedger:
    """Next turn per session, from interaction documents seen in order."""

    def __init__(self) -> None:
        self.next: dict[str, int] = {}
        self.closed: set[str] = set()
        self.owners: dict[str, str] = {}  # session -> user_id of its first interaction seen

    def add(self, doc: Any) -> None:
        if not isinstance(doc, dict) or doc.get("type") != "interaction":
            return
        session, turn = doc.get("session_id"), doc.get("turn")
        if not isinstance(session, str) or not isinstance(turn, int) or isinstance(turn, bool):
            return
        user = doc.get("user_id")
        if isinstance(user, str) and user:
            self.owners.setdefault(session, user)
        if doc.get("session_done") is True:
            self.closed.add(session)
            self.next.pop(session, None)
            return
        if session in self.closed:
            return
        self.next[session] = max(self.next.get(session, 0), turn + 1)

    def add_values(self, values: Iterable[bytes]) -> None:
        for raw in values:
            try:
                self.add(orjson.loads(raw))
            except orjson.JSONDecodeError:
                continue

    def open_sessions(self) -> dict[str, int]:
        return dict(self.next)


def read_recent(
    kafka: Connectable, topic: str, lookback_s: float, timeout: float = 5.0
) -> TurnLedger:
    """Interactions of the last ``lookback_s`` seconds, up to the end as of now."""
    from pipeline.kafka.consumer import coordinates

    ledger = TurnLedger()
    consumer = Consumer(
        connection_of(kafka).client_config(
            **{
                "group.id": "liverl-gateway-turns",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                # The recorder's transactions end in a commit marker that is never handed
                # over: the end is where the partition says so, not the last offset + 1.
                "enable.partition.eof": True,
                "logger": GATEWAY_KAFKA_LOG,  # not raw stderr lines while the broker is down
            }
        )
    )
    try:
        md = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if md is None or md.error is not None:
            return ledger
        since = int((time.time() - lookback_s) * 1000)
        starts = consumer.offsets_for_times(
            [TopicPartition(topic, p, since) for p in md.partitions], timeout=timeout
        )
        ends: dict[int, int] = {}
        assign = []
        for tp in starts:
            _low, high = consumer.get_watermark_offsets(
                TopicPartition(topic, tp.partition), timeout=timeout
            )
            if tp.offset >= 0 and tp.offset < high:
                ends[tp.partition] = high
                assign.append(tp)
        if not assign:
            return ledger
        consumer.assign(assign)
        done: set[int] = set()
        deadline = time.monotonic() + max(timeout, 60.0)
        while len(done) < len(ends) and time.monotonic() < deadline:
            for msg in consumer.consume(1000, timeout=0.5):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        done.add(msg.partition())  # type: ignore[arg-type]
                    continue
                ledger.add_values([msg.value() or b""])
                _topic, partition, offset = coordinates(msg)
                if offset + 1 >= ends[partition]:
                    done.add(partition)
        if len(done) < len(ends):
            log.warning(
                "turn recovery stopped early: %d of %d partitions read to the end",
                len(done),
                len(ends),
            )
    finally:
        consumer.close()
    return ledger
