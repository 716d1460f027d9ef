"""Reading a topic's decoded events for people (``liverl tap``; its command is in
``kafka/commands.py``).

The tap never touches any consumer group: it assigns partitions directly (start offsets
from ``offsets_for_times`` for ``--since``), runs with ``enable.auto.commit=false`` and a
throwaway group id that never joins (no ``subscribe``), and never commits. Without
``--follow`` it stops at the end offsets captured when it started (or after ``--limit``).
Records that do not decode are shown as such, never a crash.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

from pipeline.kafka.connection import Connectable, connection_of
from pipeline.kafka.errors import TapError, TopicMissing
from pipeline.kafka.names import short_name

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    pass

TAP_GROUP_PREFIX = "liverl-tap-"
_SUMMARY_CHARS = 60
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


# ---- arguments -----------------------------------------------------------------------------


def parse_since(value: str, now_ms: int | None = None) -> int:
    """``10m``/``2h``/``30s``/``1d`` ago, or an ISO time (naive = UTC), to epoch ms."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    match = _DURATION.match(value)
    if match:
        return now - int(float(match.group(1)) * _UNIT_MS[match.group(2)])
    try:
        parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise TapError(
            f"--since: {value!r} is neither a duration (e.g. 30s, 10m, 2h, 1d) nor an ISO time "
            "(e.g. 2026-05-01T12:00:00Z)"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def spec_types(connection: Connectable) -> dict[str, str]:
    from pipeline.kafka.consumer import expected_types_from_specs

    return expected_types_from_specs(connection)


def known_list(known: list[str]) -> str:
    return ", ".join(f"{short_name(t)} ({t})" for t in sorted(known))


def resolve_topic(name: str, known: list[str]) -> str:
    """A full or short topic name. A dotted name that is not in ``topics/`` (e.g. a replay
    namespace's ``replay.X.liverl.rewards.v1``) is passed on for the broker to confirm."""
    if name in known:
        return name
    matches = [t for t in known if short_name(t) == name or t == f"liverl.{name}.v1"]
    if len(matches) == 1:
        return matches[0]
    if "." in name or "-" in name:
        return name
    raise TapError(f"unknown topic {name!r}; known topics: {known_list(known)}")


def expected_type(topic: str, types: dict[str, str]) -> str | None:
    """The event type a topic carries; a namespaced copy (``replay.X.<topic>``) inherits it."""
    if topic in types:
        return types[topic]
    for name, kind in types.items():
        if topic.endswith("." + name):
            return kind
    return None


# ---- rows ----------------------------------------------------------------------------------


@dataclass
class TapRow:
    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    event: Any = None  # events.Event when decoded
    error: str | None = None
    value: bytes | None = None

    @property
    def type(self) -> str:
        if self.event is not None:
            return str(self.event.type)
        return "tombstone" if self.value is None else "undecodable"

    def kafka(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "timestamp_ms": self.timestamp_ms,
            "key": None if self.key is None else self.key.decode("utf-8", "replace"),
        }

    def to_json(self) -> bytes:
        from pipeline import events

        if self.event is not None:
            doc: dict[str, Any] = events.to_dict(self.event)
        else:
            raw = self.value or b""
            doc = {
                "type": self.type,
                "error": self.error,
                "value_head": raw[:500].decode("utf-8", "replace"),
                "value_bytes": len(raw),
            }
        doc["_kafka"] = self.kafka()
        return orjson.dumps(doc)


def _head(text: Any, n: int = _SUMMARY_CHARS) -> str:
    one = " ".join(str(text if text is not None else "").split())
    return one if len(one) <= n else one[: n - 1] + "…"


def _num(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def summary(row: TapRow) -> str:
    """A one-line human summary per event type."""
    e = row.event
    if e is None:
        return _head(row.error or "", 100)
    t = e.type
    turn = f"turn {e.turn} " if hasattr(e, "turn") else ""
    if t == "interaction":
        return f"{turn}v{e.weight_version} {e.finish_reason}: {_head(e.response_text)}"
    if t == "next_state":
        extra = f" score={_num(e.score)}" if e.score is not None else ""
        extra += f" exit={e.exit_code}" if e.exit_code is not None else ""
        return f"{turn}{e.kind}{extra}: {_head(e.content)}"
    if t == "prm_score":
        return f"{turn}score {e.score} votes {e.votes} {e.judge_id}" + (
            f" error: {_head(e.error, 40)}" if e.error else ""
        )
    if t == "hint":
        return f"{turn}rank {e.rank} {e.judge_id}: {_head(e.hint)}"
    if t == "path_penalty":
        bonus = _num(e.compliance_bonus)
        return f"{turn}penalty {_num(e.penalty)} bonus {bonus} rules {e.rule_ids}"
    if t == "reward":
        return (
            f"{turn}total {_num(e.total)} (outcome {_num(e.outcome)} prm {_num(e.prm)} "
            f"penalty {_num(e.penalty)}) {e.formula_version}"
        )
    if t == "sample":
        hints = f"hints {len(e.hints)}" + (f": {_head(e.hints[0], 40)}" if e.hints else "")
        masked = " masked" if e.masked else ""
        return f"{turn}reward {_num(e.reward)} {hints} v{e.behavior_weight_version}{masked}"
    if t == "gradient_step":
        losses = " ".join(f"{k}={_num(v)}" for k, v in sorted(e.losses.items()))
        return f"{e.policy_id} step {e.step} {losses} samples {e.samples} v{e.weight_version}"
    if t == "weights":
        return f"{e.policy_id} v{e.version} {e.status} step {e.step} parent {_num(e.parent)}"
    if t == "serving_status":
        state = "ok" if e.ok else f"error: {_head(e.error, 40)}"
        return f"{e.replica_id} {e.policy_id} v{e.version} {state} ({_num(e.reload_ms)} ms)"
    if t == "trainer_status":
        judging = (
            f" judging v{e.judging_version} {e.prompts_done}/{e.prompts_total}"
            if e.judging_version is not None
            else ""
        )
        return f"{e.policy_id} {e.state} v{e.version} step {e.step}{judging}"
    if t == "gate_vote":
        scores = f" ({_num(e.candidate_score)} vs {_num(e.live_score)})"
        scores = scores if e.candidate_score is not None or e.live_score is not None else ""
        return (
            f"{e.policy_id} v{e.version} vs v{e.live_version} {e.judge} {e.source} "
            f"{e.prompt_id[:12]} vote {e.vote:+d}{scores}"
        )
    if t == "judge_consistency":
        flag = f" FLAGGED: {_head(e.reason, 40)}" if e.flagged else ""
        return (
            f"{e.judge_id} {e.judge_version} verdict {e.verdict:+d} outcome {e.outcome:+d} "
            f"consistency {e.consistency:.3f} ({e.agree}/{e.agree + e.disagree}){flag}"
        )
    if t == "verified_task":
        yes = sum(1 for v in e.votes if v.get("vote") == 1)
        return (
            f"{e.task_id} {e.status} ({yes}/{e.k} judges) {e.checker.get('kind')} "
            f"{e.provenance.get('session_id')}: {_head(e.prompt, 40)}"
        )
    if t == "dlq":
        return f"{e.source_topic}[{e.source_partition}]@{e.source_offset}: {_head(e.error)}"
    from pipeline.events import json_default  # pragma: no cover - new types

    return _head(orjson.dumps(row.event, default=json_default).decode(), 100)  # pragma: no cover


def fmt_ts(ms: int) -> str:
    if ms <= 0:
        return "-"
    dt = datetime.fromtimestamp(ms / 1000, tz=UTC)
    return dt.strftime("%Y-%m-%d %H:%M:%S.") + f"{dt.microsecond // 1000:03d}"


# ---- reading -------------------------------------------------------------------------------


def tap_records(
    connection: Connectable,
    topic: str,
    *,
    since_ms: int | None = None,
    follow: bool = False,
    session: str | None = None,
    limit: int | None = None,
    expected: str | None = None,
    timeout: float = 30.0,
) -> Iterator[TapRow]:
    """Yield the topic's records in per-partition order; never commits any offsets."""
    from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException
    from confluent_kafka import TopicPartition as TP

    from pipeline import events
    from pipeline.kafka.consumer import coordinates
    from pipeline.kafka.reader import one_shot_reader

    kafka = connection_of(connection)
    # Never joins (assign, no subscribe) and never commits: no group state at all.
    consumer = one_shot_reader(kafka, TAP_GROUP_PREFIX)
    try:
        meta = consumer.list_topics(topic, timeout=timeout)
        tmeta = meta.topics.get(topic)
        if tmeta is None or tmeta.error is not None or not tmeta.partitions:
            raise TopicMissing(f"no such topic on the broker ({kafka.bootstrap})")
        partitions = sorted(tmeta.partitions)
        ends: dict[int, int] = {}
        for p in partitions:
            _low, high = consumer.get_watermark_offsets(TP(topic, p), timeout=timeout)
            ends[p] = high
        if since_ms is not None:
            found = consumer.offsets_for_times(
                [TP(topic, p, since_ms) for p in partitions], timeout=timeout
            )
            # -1: no record at or after the time -> start at the end.
            starts = {
                tp.partition: (tp.offset if tp.offset >= 0 else ends[tp.partition]) for tp in found
            }
            assignment = [TP(topic, p, starts[p]) for p in partitions]
        else:
            starts = {p: 0 for p in partitions}
            assignment = [TP(topic, p, OFFSET_BEGINNING) for p in partitions]
        pending = set() if follow else {p for p in partitions if starts[p] < ends[p]}
        if not follow and not pending:
            return
        consumer.assign(assignment)
        want_key = session.encode() if session is not None else None
        shown = 0
        while follow or pending:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(msg.partition())
                    continue
                if err.fatal():
                    raise KafkaException(err)
                log.warning("tap: %s", err)
                continue
            _topic, p, offset = coordinates(msg)
            if not follow:
                if p not in pending or offset >= ends[p]:
                    pending.discard(p)
                    continue
                if offset + 1 >= ends[p]:
                    pending.discard(p)
            if want_key is not None and msg.key() != want_key:
                continue
            value = msg.value()
            row = TapRow(topic, p, offset, msg.timestamp()[1], msg.key(), value=value)
            if value is None:
                row.error = "tombstone (null value)"
            else:
                try:
                    row.event = events.decode(value, expected_type=expected)
                except Exception as exc:  # noqa: BLE001 - show the record, never crash
                    row.error = f"{type(exc).__name__}: {exc}"
            yield row
            shown += 1
            if limit is not None and shown >= limit:
                return
    finally:
        # close() without commit: auto-commit is off and nothing was ever stored.
        consumer.close()
