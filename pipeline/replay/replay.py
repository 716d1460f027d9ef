"""Replay: republish a range of live events, byte-exact, into a namespace.

Each source partition is copied to the same partition of the namespace's copy of its topic, in
offset order, so per-session order (and key -> partition placement) is what it was live.
Key, value and headers are kept; six headers say where a record came from
(``liverl-replay-topic/-partition/-offset/-timestamp``) and which replay wrote it
(``liverl-replay-run``, ``liverl-replay-pass``), and the record timestamp is the original.

Resumable and idempotent, with the destination as the record of progress:

- The first run fixes the range as offsets per source partition (relative times such as
  ``2h`` are resolved once) and writes it to ``<state_dir>/replay/NAME/replay.json``, the
  manifest, before producing anything.
- A later run of the same request reads, per destination partition, the newest record that
  carries this run's headers (scanning back from the end past records the namespace's own
  workers wrote) and continues after its source offset. The producer is idempotent and
  gapless (``enable.gapless.guarantee``), so what reached a partition is always a prefix of
  its source range, whatever killed the previous run: nothing is lost or repeated.
- A pass that finished is marked in the manifest; running it again adds nothing unless
  ``--again`` asks for one more pass (its records carry the next pass number).

Why the destination and not a progress file for offsets: a file written after delivery is one
crash away from being behind what was delivered (a resume would duplicate), and one written
before is ahead (a resume would lose). The manifest only holds what never changes during a
pass: the range, and which passes completed.
"""

from __future__ import annotations

import gc
import hashlib
import heapq
import logging
import re
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from operator import itemgetter
from pathlib import Path
from typing import Any

import orjson

from pipeline.durable import atomic_write
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable, connection_of
from pipeline.replay.errors import DeliveryFailed, ReplayArgumentError, ReplayError

H_TOPIC = "liverl-replay-topic"
H_PARTITION = "liverl-replay-partition"
H_OFFSET = "liverl-replay-offset"
H_TIMESTAMP = "liverl-replay-timestamp"
H_RUN = "liverl-replay-run"
H_PASS = "liverl-replay-pass"
MANIFEST = "replay.json"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_SPEED = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*x\s*$", re.IGNORECASE)


def _not_ready_codes() -> frozenset[int]:
    from confluent_kafka import KafkaError

    return frozenset(
        {
            KafkaError.NOT_LEADER_FOR_PARTITION,
            KafkaError.LEADER_NOT_AVAILABLE,
            KafkaError.UNKNOWN_TOPIC_OR_PART,
            KafkaError._UNKNOWN_PARTITION,
        }
    )


_NOT_READY = _not_ready_codes()

# A source record: (timestamp_ms, topic, partition, offset, key, value, headers).
Row = tuple[int, str, int, int, "bytes | None", "bytes | None", "list[tuple[str, Any]] | None"]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# ---- arguments -------------------------------------------------------------------------------


def parse_time(value: str, option: str = "--since", now: int | None = None) -> int:
    """``30s``/``10m``/``2h``/``1d``/``1w`` ago, ``now``, or ISO-8601 (naive = UTC) -> epoch ms."""
    current = now_ms() if now is None else now
    text = value.strip()
    if text.lower() == "now":
        return current
    match = _DURATION.match(text)
    if match:
        return current - int(float(match.group(1)) * _UNIT_MS[match.group(2)])
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ReplayArgumentError(
            f"{option}: {value!r} is neither a duration ago (30s, 10m, 2h, 1d, 1w), 'now', nor "
            "an ISO-8601 time (2026-05-01T12:00:00Z)"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def canonical_time(value: str | None) -> str | None:
    """How a time argument is compared between runs: a relative one as typed (``2h`` names the
    same request tomorrow; its range was fixed by the first run), an absolute one as epoch ms."""
    if value is None:
        return None
    text = value.strip().lower()
    if text == "now" or _DURATION.match(text):
        return "ago:" + text.replace(" ", "")
    return f"ms:{parse_time(value)}"


def parse_speed(value: str) -> float | None:
    """``max`` -> None (as fast as possible); ``1x``, ``10x``, ``0.5x`` -> the factor."""
    text = value.strip().lower()
    if text == "max":
        return None
    match = _SPEED.match(text)
    factor = float(match.group(1)) if match else 0.0
    if factor <= 0:
        raise ReplayArgumentError(
            f"--speed: {value!r}: use max, or a positive factor such as 1x or 10x"
        )
    return factor


def fmt_ms(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


# ---- the manifest ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One source partition's range: offsets ``start <= o < end``."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)


@dataclass
class Manifest:
    namespace: str
    request: dict[str, Any]
    spans: list[Span]
    since_ms: int | None = None
    until_ms: int | None = None
    run_id: str = ""
    passes: int = 1  # the pass being (or last) run
    completed: int = 0  # the last pass that finished
    created_ms: int = field(default_factory=now_ms)

    def __post_init__(self) -> None:
        if not self.run_id:
            body = orjson.dumps(
                {
                    "ns": self.namespace,
                    "request": self.request,
                    "spans": [asdict(s) for s in self.spans],
                },
                option=orjson.OPT_SORT_KEYS,
            )
            self.run_id = hashlib.sha256(body + uuid.uuid4().bytes).hexdigest()[:16]

    @property
    def total(self) -> int:
        return sum(s.size for s in self.spans)

    def save(self, path: Path) -> None:
        """Atomically (temp file, fsync, rename, fsync the folder)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2))

    @classmethod
    def load(cls, path: Path) -> Manifest | None:
        if not path.is_file():
            return None
        doc = orjson.loads(path.read_bytes())
        doc["spans"] = [Span(**s) for s in doc["spans"]]
        return cls(**doc)


def describe_request(request: dict[str, Any]) -> str:
    parts = [f"--from {request['from']}", "--topics " + ",".join(request["topics"])]
    for opt in ("since", "until"):
        if request.get(opt):
            kind, _, val = str(request[opt]).partition(":")
            parts.append(f"--{opt} {val if kind == 'ago' else fmt_ms(int(val))}")
    if request.get("sessions"):
        parts.append("--sessions " + ",".join(request["sessions"]))
    return " ".join(parts)


# ---- Kafka plumbing --------------------------------------------------------------------------


# A read up to a known end offset gives up after this long without a record. Longer than
# Kafka's default transaction timeout (60 s): read_committed waits for an open transaction.
READ_STALL_S = 120.0


def reader(settings: Connectable, **extra: Any) -> Any:
    """An assign-only consumer that never joins a group and never commits."""
    from pipeline.kafka.reader import one_shot_reader

    return one_shot_reader(settings, "liverl-replay-reader-", **extra)


def partitions_of(consumer: Any, topic: str, timeout: float = 15.0) -> list[int] | None:
    meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        return None
    return sorted(meta.partitions)


def watermarks(consumer: Any, topic: str, partition: int, timeout: float = 30.0) -> tuple[int, int]:
    """(low, high) of a partition, retried while a new topic's leader is being elected."""
    from confluent_kafka import KafkaException, TopicPartition

    deadline = time.monotonic() + timeout
    while True:
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), 10)
            return int(low), int(high)
        except KafkaException as exc:
            err = exc.args[0]
            waitable = err.retriable() or err.code() in _NOT_READY
            if not waitable or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def read_range(consumer: Any, topic: str, partition: int, lo: int, hi: int) -> list[Any]:
    """Records of one partition with ``lo <= offset < hi`` (fewer if some were removed)."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    if lo >= hi:
        return []
    consumer.assign([TopicPartition(topic, partition, lo)])
    out: list[Any] = []
    try:
        while True:
            msg = consumer.poll(5.0)
            if msg is None:
                raise ReplayError(f"no answer reading {topic}[{partition}] at {lo}")
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return out
                if err.fatal():
                    raise KafkaException(err)
                continue
            if msg.offset() >= hi:
                return out
            out.append(msg)
            if msg.offset() + 1 >= hi:
                return out
    finally:
        consumer.unassign()


def replay_headers(msg: Any) -> dict[str, bytes]:
    return {k: v for k, v in (msg.headers() or []) if k.startswith("liverl-replay-") and v}


def last_replayed(
    consumer: Any,
    topic: str,
    partition: int,
    accept: Callable[[dict[str, bytes]], bool | None],
) -> dict[str, bytes] | None:
    """Replay headers of the newest record in ``topic[partition]`` that ``accept`` takes
    (True); None when it rejects one first (False) or none has replay headers. Scans back from
    the end in growing windows: a namespace's own workers write between replayed records."""

    low, high = watermarks(consumer, topic, partition)
    window, hi = 64, high
    while hi > low:
        lo = max(low, hi - window)
        for msg in reversed(read_range(consumer, topic, partition, lo, hi)):
            found = replay_headers(msg)
            if found:
                verdict = accept(found)
                if verdict is True:
                    return found
                if verdict is False:
                    return None
        hi, window = lo, window * 4
    return None


# ---- sources ---------------------------------------------------------------------------------


@dataclass(eq=False)
class KafkaSource:
    """Live topics on the cluster, read with assign (no group, no commit)."""

    kind = "kafka"

    settings: Connectable
    examined: int = field(default=0, init=False)
    _consumer: Any = field(default=None, init=False, repr=False)

    @property
    def consumer(self) -> Any:
        if self._consumer is None:
            self._consumer = reader(self.settings)  # metadata and offsets only
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def spans(
        self,
        topics: list[str],
        since_ms: int | None,
        until_ms: int | None,
        session_partitions: Callable[[str, int], set[int] | None],
    ) -> list[Span]:
        """The offsets of ``since <= timestamp < until`` per partition (end: the high
        watermark when no --until). Missing topics raise a UsageError."""

        c = self.consumer
        found: dict[str, list[int]] = {}
        missing = []
        for topic in topics:
            parts = partitions_of(c, topic)
            if parts is None:
                missing.append(topic)
            else:
                found[topic] = parts
        if missing:
            bootstrap = connection_of(self.settings).bootstrap
            raise ReplayArgumentError(
                f"topic(s) {', '.join(missing)} not on the broker ({bootstrap}); "
                "`liverl topics apply` creates them"
            )
        out = []
        for topic, parts in found.items():
            wanted = session_partitions(topic, len(parts))
            for p in parts:
                if wanted is not None and p not in wanted:
                    continue
                low, high = watermarks(c, topic, p)
                start, end = low, high
                if since_ms is not None:
                    start = self._offset_at(topic, p, since_ms, high)
                if until_ms is not None:
                    end = self._offset_at(topic, p, until_ms, high)
                start = max(start, low)
                if end > start:
                    out.append(Span(topic, p, start, end))
        return out

    def _offset_at(self, topic: str, partition: int, ts_ms: int, high: int) -> int:
        from confluent_kafka import TopicPartition

        (tp,) = self.consumer.offsets_for_times([TopicPartition(topic, partition, ts_ms)], 15)
        return tp.offset if tp.offset >= 0 else high  # -1: nothing at or after ts_ms

    def keys_present(self, spans: list[Span], keys: set[bytes]) -> set[bytes]:
        """Which of ``keys`` occur in the spans (stops early once all are seen)."""
        seen: set[bytes] = set()
        for row in self.read(spans, {(s.topic, s.partition): s.start for s in spans}, keys):
            if row[4] is not None:  # always: only records with one of ``keys`` are read
                seen.add(row[4])
            if seen >= keys:
                break
        self.examined = 0
        self.close()
        return seen

    def read(
        self, spans: list[Span], starts: dict[tuple[str, int], int], keys: set[bytes] | None
    ) -> Iterator[Row]:
        """Records of every span from ``starts``, merged by timestamp across partitions (each
        partition stays in offset order).

        Why merge, even at max speed: fetches are sized in bytes, so a topic of small records
        (next states) would run hours ahead of one of large records (interactions), and a
        namespace's judge dead-letters a next state whose interaction is more than ``grace_s``
        late. One consumer per partition gives the merge backpressure for free: a partition
        that is not read stops fetching once its small local queue is full (pausing a shared
        consumer instead would drop its prefetched records and fetch them again)."""
        active = [s for s in spans if starts[(s.topic, s.partition)] < s.end]
        if not active:
            return
        readers = [self._partition_reader(s, starts[(s.topic, s.partition)], keys) for s in active]
        try:
            yield from heapq.merge(*readers, key=itemgetter(0))
        finally:
            for r in readers:
                r.close()

    def _partition_reader(
        self, span: Span, start: int, keys: set[bytes] | None
    ) -> Generator[Row, None, None]:
        from confluent_kafka import KafkaError, KafkaException, TopicPartition

        c = reader(
            self.settings,
            **{
                # Small queue and partition fetches (a larger record still comes whole: a fetch
                # always returns at least one batch): memory stays a few MB per partition.
                "queued.max.messages.kbytes": 8192,
                "max.partition.fetch.bytes": 2 * 1024 * 1024,
                "fetch.wait.max.ms": 50,
            },
        )
        topic, partition, end = span.topic, span.partition, span.end
        eof = KafkaError._PARTITION_EOF
        try:
            c.assign([TopicPartition(topic, partition, start)])
            idle_since = time.monotonic()
            while True:
                first = c.poll(1.0)
                if first is None:
                    if time.monotonic() - idle_since > READ_STALL_S:
                        raise ReplayError(
                            f"reading {topic}[{partition}]: no record for "
                            f"{READ_STALL_S:.0f}s before offset {end} (broker down?)"
                        )
                    continue
                idle_since = time.monotonic()
                msgs = [first, *c.consume(num_messages=2000, timeout=0)]
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.code() == eof and msg.offset() >= end:
                            return
                        if err.fatal():
                            raise KafkaException(err)
                        continue
                    off = msg.offset()
                    if off >= end:
                        return
                    self.examined += 1
                    key = msg.key()
                    if keys is None or key in keys:
                        yield (
                            msg.timestamp()[1], topic, partition, off, key, msg.value(),
                            msg.headers(),
                        )  # fmt: skip
                    if off + 1 >= end:
                        return
        finally:
            c.close()


@dataclass(eq=False)
class DeltaSource:
    """The archive (``pipeline/lake/archive.py``): ``<lake>/events/<topic>`` Delta tables."""

    kind = "delta"

    settings: Connectable
    lake_root: Path
    partitions: Callable[[str], int | None] = lambda topic: None  # topic -> the spec's count
    examined: int = field(default=0, init=False)
    _tables: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _window: tuple[int | None, int | None] = field(default=(None, None), init=False)

    def __post_init__(self) -> None:
        self.lake_root = Path(self.lake_root)

    def window(self, since_ms: int | None, until_ms: int | None) -> None:
        """The time range read from the tables (a resumed run sets the manifest's)."""
        if (since_ms, until_ms) != self._window:
            self._window = (since_ms, until_ms)
            self._tables.clear()

    def close(self) -> None:
        self._tables.clear()

    def _table(self, topic: str) -> Any:
        from pipeline.lake import archive

        if topic not in self._tables:
            since, until = self._window
            try:
                # --sessions filters on record keys here too (as for --from kafka), not on
                # the decoded session_id: a record that is not an envelope has none.
                self._tables[topic] = archive.read_archived(
                    self.lake_root,
                    topic,
                    since,
                    until,
                    columns=["partition", "offset", "timestamp_ms", "key", "payload", "headers"],
                )
            except archive.ArchiveError as exc:
                raise ReplayArgumentError(exc.message) from None
        return self._tables[topic]

    def spans(
        self,
        topics: list[str],
        since_ms: int | None,
        until_ms: int | None,
        session_partitions: Callable[[str, int], set[int] | None],
    ) -> list[Span]:
        """Per archived partition, the offsets of the rows in the window."""
        self.window(since_ms, until_ms)
        out = []
        for topic in topics:
            table = self._table(topic)
            if table.num_rows == 0:
                continue
            count = self.partitions(topic)
            wanted = session_partitions(topic, count) if count else None
            grouped = table.group_by("partition").aggregate([("offset", "min"), ("offset", "max")])
            for row in grouped.to_pylist():
                if wanted is not None and row["partition"] not in wanted:
                    continue
                out.append(Span(topic, row["partition"], row["offset_min"], row["offset_max"] + 1))
        return sorted(out, key=lambda s: (s.topic, s.partition))

    def keys_present(self, spans: list[Span], keys: set[bytes]) -> set[bytes]:
        import pyarrow as pa
        import pyarrow.compute as pc

        seen: set[bytes] = set()
        wanted = pa.array(sorted(keys), type=pa.binary())
        for topic in {s.topic for s in spans}:
            column = self._table(topic).column("key")
            seen.update(pc.unique(column.filter(pc.is_in(column, wanted))).to_pylist())
        return seen

    def read(
        self, spans: list[Span], starts: dict[tuple[str, int], int], keys: set[bytes] | None
    ) -> Iterator[Row]:
        import pyarrow.compute as pc

        from pipeline.lake.archive import kafka_headers

        def stream(span: Span, start: int) -> Iterator[Row]:
            table = self._table(span.topic)
            mask = pc.and_(
                pc.equal(table.column("partition"), span.partition),
                pc.and_(
                    pc.greater_equal(table.column("offset"), start),
                    pc.less(table.column("offset"), span.end),
                ),
            )
            part = table.filter(mask)
            cols = [
                part.column(n).to_pylist()
                for n in ("timestamp_ms", "offset", "key", "payload", "headers")
            ]
            for ts, off, key, value, headers in zip(*cols, strict=True):
                self.examined += 1
                if keys is None or key in keys:
                    yield (ts, span.topic, span.partition, off, key, value, kafka_headers(headers))

        iters = [
            stream(s, starts[(s.topic, s.partition)])
            for s in spans
            if starts[(s.topic, s.partition)] < s.end
        ]
        yield from heapq.merge(*iters, key=itemgetter(0))


# ---- the replay ------------------------------------------------------------------------------


@dataclass
class Stats:
    produced: int = 0
    examined: int = 0
    seconds: float = 0.0
    left_to_workers: int = 0  # derived next states not copied (see :func:`rederived`)

    @property
    def rate(self) -> float:
        return self.produced / self.seconds if self.seconds > 0 else 0.0


# Tells a record the namespace's own workers make again: (live topic, value) -> skip it.
Skip = Callable[[str, "bytes | None"], bool]


def rederived(topics: Iterable[str]) -> Skip | None:
    """Next states the live pairing derived, when ``interactions`` is replayed too: the
    namespace's session agent derives each of them again from the replayed interactions (the
    same event id for the same ``pairing_version``), so a copy would leave the namespace's
    ``next_states`` with every derived next state twice. Next states from outside (outcomes,
    feedback, a gateway's) are copied. Without ``interactions`` nothing derives them again:
    None, every record is copied."""
    if not {names.INTERACTIONS, names.NEXT_STATES} <= set(topics):
        return None
    from pipeline import events
    from pipeline.processors.session import is_derived

    def derived(topic: str, value: bytes | None) -> bool:
        if topic != names.NEXT_STATES or value is None:
            return False
        try:
            event = events.decode(value, "next_state")
        except events.EventValidationError:
            return False  # not an event we can read: copied byte-exact like any record
        return isinstance(event, events.NextState) and is_derived(event)

    return derived


class QueueStuck(RuntimeError):
    """The producer's queue stayed full: nothing reached the broker for too long."""


def resume_points(
    settings: Connectable, manifest: Manifest
) -> tuple[dict[tuple[str, int], int], int]:
    """Per source partition, the first offset this pass has not delivered yet (from the
    destination's replay headers), and how many partitions had a partial pass."""
    run = manifest.run_id.encode()
    this_pass = str(manifest.passes).encode()

    def accept(h: dict[str, bytes]) -> bool | None:
        if h.get(H_RUN) != run:
            return False  # another run's record: this run never wrote after it
        return h.get(H_PASS) == this_pass

    starts: dict[tuple[str, int], int] = {}
    resumed = 0
    consumer = reader(settings)
    try:
        for span in manifest.spans:
            dest = names.resolve(span.topic, manifest.namespace)
            found = last_replayed(consumer, dest, span.partition, accept)
            start = span.start
            if found is not None:
                start = max(start, int(found[H_OFFSET]) + 1)
                resumed += 1
            starts[(span.topic, span.partition)] = start
    finally:
        consumer.close()
    return starts, resumed


def foreign_replays(settings: Connectable, namespace: str, topics: list[str]) -> str | None:
    """A replay run id found in the namespace's copies of ``topics`` (None: none), for a
    namespace whose manifest is gone (another state dir)."""
    consumer = reader(settings)
    try:
        for topic in topics:
            dest = names.resolve(topic, namespace)
            for p in partitions_of(consumer, dest, timeout=10) or []:
                found = last_replayed(consumer, dest, p, lambda h: True)
                if found is not None:
                    return found.get(H_RUN, b"?").decode(errors="replace")
    finally:
        consumer.close()
    return None


class _Quiet(logging.Filter):
    """librdkafka warns that enable.gapless.guarantee is experimental on every start."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "gapless.guarantee is experimental" not in record.getMessage()


_client_log = logging.getLogger("pipeline.replay.librdkafka")
_client_log.addFilter(_Quiet())


def _rate_column() -> Any:
    """A rich progress column: events per second."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed or 0:,.0f} ev/s", style="progress.data.speed")

    return RateColumn()


def run(
    settings: Connectable,
    manifest: Manifest,
    source: KafkaSource | DeltaSource,
    starts: dict[tuple[str, int], int],
    *,
    speed: float | None,
    keys: set[bytes] | None,
    console: Any = None,
    producer_config: dict[str, Any] | None = None,
    skip: Skip | None = None,
) -> Stats:
    """Copy the spans from ``starts`` into the namespace, except the records ``skip`` takes
    (see :func:`rederived`); returns counts and time. A resumed run reads a skipped record
    again and skips it again: only copied records mark progress."""
    from confluent_kafka import KafkaError, KafkaException, Producer
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    console = console or Console(stderr=True)
    conn = connection_of(settings)
    conf = conn.client_config(
        **{
            "client.id": f"liverl-replay-{manifest.namespace}",
            "enable.idempotence": True,
            "acks": "all",
            # Fail fatally rather than leave a gap: what reached a partition must stay a
            # prefix of its source, or resuming from the newest record would lose some.
            "enable.gapless.guarantee": True,
            # No local expiry either (gapless does not cover it): a record is delivered or
            # the run stops; the next run resumes after the prefix that arrived.
            "message.timeout.ms": 0,
            "delivery.report.only.error": True,  # a Python callback per record costs ~10%
            "logger": _client_log,
            "compression.type": conn.compression,
            "message.max.bytes": conn.max_record_bytes,
            "linger.ms": 5 if speed is not None else 50,
            "batch.size": 1_000_000,
            "queue.buffering.max.kbytes": 131072,
            **(producer_config or {}),
        }
    )
    producer = Producer(conf)
    failures: list[str] = []

    def on_delivery(err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            failures.append(f"{msg.topic()}[{msg.partition()}]: {err}")

    ns = manifest.namespace
    dest = {s.topic: names.resolve(s.topic, ns) for s in manifest.spans}
    topic_b = {t: t.encode() for t in dest}
    part_b = {s.partition: str(s.partition).encode() for s in manifest.spans}
    run_b, pass_b = manifest.run_id.encode(), str(manifest.passes).encode()
    remaining = sum(max(0, s.end - starts[(s.topic, s.partition)]) for s in manifest.spans)
    stats = Stats()
    produce, poll = producer.produce, producer.poll
    progress = Progress(
        TextColumn(f"replay into {ns}"),
        BarColumn(),
        MofNCompleteColumn(),
        _rate_column(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    task = progress.add_task("replay", total=remaining)
    started = time.monotonic()
    # Nothing here makes reference cycles; the cyclic GC would only rescan the in-flight rows.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    t0_wall: float | None = None
    t0_ts = 0
    try:
        with progress:
            for n, row in enumerate(source.read(manifest.spans, starts, keys), 1):
                ts, topic, partition, offset, key, value, headers = row
                if skip is not None and skip(topic, value):
                    stats.left_to_workers += 1
                    continue
                if speed is not None:
                    if t0_wall is None:
                        t0_wall, t0_ts = time.monotonic(), ts
                    due = t0_wall + (ts - t0_ts) / 1000.0 / speed
                    while (wait := due - time.monotonic()) > 0:
                        poll(min(wait, 0.05))
                hdrs = list(headers) if headers else []
                hdrs += (
                    (H_TOPIC, topic_b[topic]),
                    (H_PARTITION, part_b[partition]),
                    (H_OFFSET, b"%d" % offset),
                    (H_TIMESTAMP, b"%d" % ts),
                    (H_RUN, run_b),
                    (H_PASS, pass_b),
                )
                full_since: float | None = None
                while True:
                    try:
                        produce(
                            dest[topic],
                            value=value,
                            key=key,
                            partition=partition,
                            timestamp=ts if ts and ts > 0 else 0,
                            headers=hdrs,
                            on_delivery=on_delivery,
                        )
                        break
                    except BufferError:  # queue full: serve delivery reports to make room
                        # Records never expire here (message.timeout.ms 0): with the broker
                        # gone the queue would stay full for ever.
                        now = time.monotonic()
                        full_since = full_since or now
                        if now - full_since > READ_STALL_S:
                            raise QueueStuck(
                                f"the producer queue stayed full for {READ_STALL_S:.0f}s "
                                "(broker unreachable?)"
                            ) from None
                        poll(0.05)
                if n & 1023 == 0 or speed is not None:
                    poll(0)
                    if failures:
                        break
                    progress.update(task, completed=source.examined)
                stats.produced += 1
            progress.update(task, completed=source.examined)
            left = producer.flush(120)
            if left:
                failures.append(f"{left} record(s) still queued after 120 s")
    except KeyboardInterrupt:
        producer.flush(30)  # keep what is queued: the next run resumes after it
        raise
    except (KafkaException, QueueStuck) as exc:  # stop; what arrived is a prefix (gapless)
        failures.append(str(exc))
    finally:
        if gc_was_enabled:
            gc.enable()
        stats.examined = source.examined
        stats.seconds = time.monotonic() - started
        if failures:
            producer.flush(30)
    if failures:
        raise DeliveryFailed(
            f"replay into {ns} stopped: {len(failures)} record(s) not delivered "
            f"({'; '.join(failures[:3])}); what was delivered is a clean prefix: "
            "run the same command again to resume"
        )
    return stats


def keys_partitions(keys: Iterable[bytes], partitions: int) -> set[int]:
    """The partitions the default (murmur2) partitioner puts these keys on."""
    from aiokafka.partitioner import murmur2

    return {(murmur2(k) & 0x7FFFFFFF) % partitions for k in keys}
