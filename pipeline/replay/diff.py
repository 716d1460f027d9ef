"""``liverl diff-rewards``: the live rewards next to a namespace's, per (session, turn).

Both topics are read with assign up to the end offsets seen at start: no consumer group joins
and no offset is committed, so a diff never moves anyone's position. Only the sessions the
namespace has rewards for are compared; on the live side only their partitions are read (the
topics are keyed by session with the same partition count) and, when the namespace's replay
manifest says where its range began, only from there on (a reward comes after its turn).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline import events
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable

from .errors import ReplayError
from .replay import READ_STALL_S, keys_partitions, partitions_of, reader, watermarks

CHANGED_EPS = 1e-9


@dataclass
class Side:
    """The newest reward per (session, turn) of one topic, in offset order."""

    rewards: dict[tuple[str, int], events.Reward] = field(default_factory=dict)
    records: int = 0
    undecodable: int = 0


@dataclass
class Row:
    session_id: str
    turn: int
    live: events.Reward | None
    new: events.Reward | None

    @property
    def delta(self) -> float | None:
        if self.live is None or self.new is None:
            return None
        return self.new.total - self.live.total

    @property
    def changed(self) -> bool:
        d = self.delta
        return d is not None and abs(d) > CHANGED_EPS

    def to_dict(self) -> dict[str, Any]:
        def parts(r: events.Reward | None) -> dict[str, Any] | None:
            if r is None:
                return None
            return {
                "total": r.total,
                "outcome": r.outcome,
                "prm": r.prm,
                "penalty": r.penalty,
                "formula_version": r.formula_version,
                "event_id": r.event_id,
            }

        return {
            "session_id": self.session_id,
            "turn": self.turn,
            "live": None if self.live is None else self.live.total,
            "new": None if self.new is None else self.new.total,
            "delta": self.delta,
            "changed": self.changed,
            "live_parts": parts(self.live),
            "new_parts": parts(self.new),
        }


@dataclass
class Diff:
    namespace: str
    rows: list[Row]
    live: Side
    new: Side

    def summary(self) -> dict[str, Any]:
        both = [r for r in self.rows if r.delta is not None]
        deltas = [abs(r.delta) for r in both if r.delta is not None]
        return {
            "namespace": self.namespace,
            "sessions": len({r.session_id for r in self.rows}),
            "turns_compared": len(both),
            "changed": sum(r.changed for r in both),
            "mean_abs_delta": (math.fsum(deltas) / len(deltas)) if deltas else 0.0,
            "max_abs_delta": max(deltas, default=0.0),
            "only_live": sum(r.new is None for r in self.rows),
            "only_namespace": sum(r.live is None for r in self.rows),
            "undecodable": self.live.undecodable + self.new.undecodable,
        }


def read_rewards(
    settings: Connectable,
    topic: str,
    *,
    keys: set[bytes] | None = None,
    since_ms: int | None = None,
) -> Side:
    """Rewards of ``topic`` up to its end offsets now; ``keys`` limits sessions (and the
    partitions read), ``since_ms`` the start."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    side = Side()
    c = reader(settings)
    try:
        parts = partitions_of(c, topic)
        if parts is None:
            raise LookupError(topic)
        if keys is not None:
            wanted = keys_partitions(keys, len(parts))
            parts = [p for p in parts if p in wanted]
        assignment, ends = [], {}
        for p in parts:
            low, high = watermarks(c, topic, p)
            start = low
            if since_ms is not None:
                (tp,) = c.offsets_for_times([TopicPartition(topic, p, since_ms)], 15)
                start = tp.offset if tp.offset >= 0 else high
            if start < high:
                assignment.append(TopicPartition(topic, p, max(start, low)))
                ends[p] = high
        if not assignment:
            return side
        c.assign(assignment)
        pending = set(ends)
        idle_since = time.monotonic()
        while pending:
            msgs = c.consume(num_messages=1000, timeout=1.0)
            if msgs:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > READ_STALL_S:
                left = ", ".join(f"{topic}[{p}]" for p in sorted(pending))
                raise ReplayError(f"reading {left}: no record for {READ_STALL_S:.0f}s")
            for msg in msgs:
                err = msg.error()
                p = msg.partition()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(p)
                        continue
                    if err.fatal():
                        raise KafkaException(err)
                    continue
                if p not in pending or msg.offset() >= ends[p]:
                    pending.discard(p)
                    continue
                if msg.offset() + 1 >= ends[p]:
                    pending.discard(p)
                if keys is not None and msg.key() not in keys:
                    continue
                side.records += 1
                try:
                    ev = events.decode(msg.value() or b"", expected_type="reward")
                except Exception:  # noqa: BLE001 - counted and shown, never fatal
                    side.undecodable += 1
                    continue
                assert isinstance(ev, events.Reward)  # decode checked the type
                side.rewards[(ev.session_id, ev.turn)] = ev
    finally:
        c.close()
    return side


def diff_rewards(settings: Connectable, namespace: str, since_ms: int | None = None) -> Diff:
    """Live vs namespace rewards for every session the namespace has rewards for."""
    new = read_rewards(settings, names.resolve(names.REWARDS, namespace))
    keys = {sid.encode() for sid, _ in new.rewards}
    live = read_rewards(settings, names.REWARDS, keys=keys, since_ms=since_ms) if keys else Side()
    rows = [
        Row(sid, turn, live.rewards.get((sid, turn)), new.rewards.get((sid, turn)))
        for sid, turn in sorted(set(live.rewards) | set(new.rewards))
    ]
    return Diff(namespace, rows, live, new)
