"""The archive: every topic copied byte-exact into a Delta table ``<lake>/events/<name>``.

Progress lives in the tables, not in a consumer group. Each commit carries, next to its rows,
one application transaction per (topic, partition) it covers: ``archive:<topic>:<partition>``
at the last offset it holds. On start the archiver reads those versions and seeks to
version + 1, so a crash at any point neither loses nor repeats an offset, and a run with
nothing new makes no commit. Two archivers racing on one partition cannot both commit it:
delta-rs refuses the second commit that records the same app id, and the loser drops the
rows the winner wrote.

Columns (``ARCHIVE_SCHEMA``): the Kafka record (``topic``, ``partition``, ``offset``,
``timestamp_ms``, ``key``, ``headers``, ``payload``: value bytes as the broker holds them,
null for a tombstone), the envelope read from the JSON value (``event_id``, ``event_type``,
``schema_version``, ``session_id``, ``turn``, ``policy_id``, ``event_ts_ms``; null with
``decode_error`` set when the value is not an event envelope: garbage is archived too), and
``day`` (UTC day of the Kafka timestamp), the partition column. ``headers`` is a list of
``{key, value}`` structs: Kafka headers are an ordered multi-map with binary values, which
a map column (DuckDB refuses duplicate keys) or JSON (no binary) would not keep.

The envelope is not validated against the schema files: the archive is a copy of what
was sent, and validity is each consumer's business (its dead letters are archived too).
"""

from __future__ import annotations

import gc
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.kafka import names
from pipeline.kafka.connection import Connectable, connection_of
from pipeline.lake.errors import ArchiveError, ArchiveStopped, MissingTopics
from pipeline.lake.writer import MultiAppender

EVENTS_DIR = "events"
APP_PREFIX = "archive"
PARTITION_BY = ["day"]

HEADER = pa.struct([("key", pa.string()), ("value", pa.binary())])
ARCHIVE_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp_ms", pa.int64()),  # Kafka record timestamp (create or log-append time)
        ("key", pa.binary()),
        ("headers", pa.list_(HEADER)),  # null: the record had none
        ("payload", pa.binary()),  # the value, byte-exact; null for a tombstone
        ("event_id", pa.string()),
        ("event_type", pa.string()),
        ("schema_version", pa.int32()),
        ("session_id", pa.string()),
        ("turn", pa.int64()),
        ("policy_id", pa.string()),
        ("event_ts_ms", pa.int64()),  # the envelope's ts_ms
        ("decode_error", pa.string()),  # why the envelope columns are null
        ("day", pa.string()),  # partition column: UTC day of timestamp_ms (YYYY-MM-DD)
    ]
)
_DAY_MS = 86_400_000


# ---- locations and reading -------------------------------------------------------------------


def table_name(topic: str) -> str:
    """The archive's table of ``topic``: its short name (``names.short_name``)."""
    return names.short_name(topic)


def archive_path(lake_root: str | Path, topic: str) -> Path:
    """The Delta table holding ``topic`` (full or short name): ``<lake_root>/events/<name>``."""
    return Path(lake_root) / EVENTS_DIR / table_name(topic)


def app_id(topic: str, partition: int) -> str:
    """Application transaction id recording a partition's last archived offset."""
    return f"{APP_PREFIX}:{topic}:{partition}"


def archived_offsets(
    lake_root: str | Path, topic: str, partitions: Iterable[int]
) -> dict[int, int]:
    """partition -> last archived offset, for the partitions that have one."""
    appender = MultiAppender(str(archive_path(lake_root, topic)))
    found = appender.committed_versions(app_id(topic, p) for p in partitions)
    return {int(a.rsplit(":", 1)[1]): v for a, v in found.items() if v is not None}


def read_archived(
    lake_root: str | Path,
    topic: str,
    since_ms: int | None = None,
    until_ms: int | None = None,
    sessions: Iterable[str] | None = None,
    *,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    """Archived records of ``topic`` ordered by (partition, offset).

    ``since_ms <= timestamp_ms < until_ms`` on the Kafka timestamp (the ``day`` partitions
    outside the window are not read); ``sessions`` keeps rows whose decoded ``session_id``
    is one of them. Raises :class:`ArchiveError` when the topic was never archived.
    """
    import pyarrow.dataset as ds
    from deltalake import DeltaTable

    from .reading import dataset as delta_dataset

    path = archive_path(lake_root, topic)
    if not DeltaTable.is_deltatable(str(path)):
        raise ArchiveError(f"{topic} is not archived: no Delta table at {path} (`liverl archive`)")
    dataset = delta_dataset(path)
    conds: list[ds.Expression] = []
    if since_ms is not None:
        conds += [ds.field("day") >= day_of(since_ms), ds.field("timestamp_ms") >= since_ms]
    if until_ms is not None:
        conds += [ds.field("day") <= day_of(until_ms), ds.field("timestamp_ms") < until_ms]
    if sessions is not None:
        conds.append(ds.field("session_id").isin(list(sessions)))
    expr = None
    for cond in conds:
        expr = cond if expr is None else expr & cond
    wanted = list(columns) if columns is not None else None
    read = None if wanted is None else list(dict.fromkeys([*wanted, "partition", "offset"]))
    table = dataset.to_table(columns=read, filter=expr)
    table = table.sort_by([("partition", "ascending"), ("offset", "ascending")])
    return table if wanted is None else table.select(wanted)


def kafka_headers(cell: list[dict[str, Any]] | None) -> list[tuple[str, bytes | None]] | None:
    """A ``headers`` cell (from ``to_pylist``) as confluent-kafka's ``headers=`` argument."""
    if cell is None:
        return None
    return [(h["key"], h["value"]) for h in cell]


# ---- building rows ---------------------------------------------------------------------------


_day_cache: dict[int, str] = {}


def day_of(ts_ms: int | None) -> str:
    """UTC day of an epoch-ms timestamp; 1970-01-01 when the record had none."""
    n = 0 if ts_ms is None or ts_ms < 0 else ts_ms // _DAY_MS
    day = _day_cache.get(n)
    if day is None:
        day = datetime.fromtimestamp(n * 86_400, tz=UTC).strftime("%Y-%m-%d")
        _day_cache[n] = day
    return day


def envelope_columns(values: Sequence[bytes | None]) -> dict[str, list[Any]]:
    """The envelope fields of each value (nulls and ``decode_error`` when it is not one)."""
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    cols: dict[str, list[Any]] = {
        k: []
        for k in (
            "event_id",
            "event_type",
            "schema_version",
            "session_id",
            "turn",
            "policy_id",
            "event_ts_ms",
            "decode_error",
        )
    }
    ids, types, versions = cols["event_id"], cols["event_type"], cols["schema_version"]
    sessions, turns, policies = cols["session_id"], cols["turn"], cols["policy_id"]
    stamps, errors = cols["event_ts_ms"], cols["decode_error"]

    def undecoded(reason: str) -> None:
        for col in (ids, types, versions, sessions, turns, policies, stamps):
            col.append(None)
        errors.append(reason)

    for raw in values:
        if raw is None:
            undecoded("tombstone (null value)")
            continue
        try:
            doc = loads(raw)
        except decode_error as exc:
            undecoded(f"not JSON: {exc}"[:300])
            continue
        if type(doc) is not dict:
            undecoded(f"not an event: a JSON {type(doc).__name__}")
            continue
        event_id, kind = doc.get("event_id"), doc.get("type")
        if type(event_id) is not str or type(kind) is not str:
            undecoded("not an event: no string event_id and type")
            continue
        ids.append(event_id)
        types.append(kind)
        v = doc.get("schema_version")
        versions.append(v if type(v) is int and -(2**31) <= v < 2**31 else None)
        v = doc.get("session_id")
        if v is None and kind == "verified_task":  # keyed by task; it names its session here
            prov = doc.get("provenance")
            v = prov.get("session_id") if type(prov) is dict else None
        sessions.append(v if type(v) is str else None)
        v = doc.get("turn")
        turns.append(v if type(v) is int and -(2**63) <= v < 2**63 else None)
        v = doc.get("policy_id")
        policies.append(v if type(v) is str else None)
        v = doc.get("ts_ms")
        stamps.append(v if type(v) is int and -(2**63) <= v < 2**63 else None)
        errors.append(None)
    return cols


@dataclass
class _Buffer:
    """Records of one topic read since its last commit, column by column."""

    partitions: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    timestamps: list[int | None] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    headers: list[list[tuple[str, bytes | None]] | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)
    nbytes: int = 0
    last: dict[int, int] = field(default_factory=dict)  # partition -> last offset buffered

    def __len__(self) -> int:
        return len(self.offsets)

    def table(self, topic: str) -> pa.Table:
        n = len(self.offsets)
        env = envelope_columns(self.values)
        arrays = {
            "topic": pa.array([topic] * n, pa.string()),
            "partition": pa.array(self.partitions, pa.int32()),
            "offset": pa.array(self.offsets, pa.int64()),
            "timestamp_ms": pa.array(self.timestamps, pa.int64()),
            "key": pa.array(self.keys, pa.binary()),
            "headers": pa.array(self.headers, ARCHIVE_SCHEMA.field("headers").type),
            "payload": pa.array(self.values, pa.binary()),
            **{name: pa.array(col, ARCHIVE_SCHEMA.field(name).type) for name, col in env.items()},
            "day": pa.array([day_of(ts) for ts in self.timestamps], pa.string()),
        }
        return pa.table([arrays[f.name] for f in ARCHIVE_SCHEMA], schema=ARCHIVE_SCHEMA)


def _writer_properties() -> Any:
    """zstd level 1: as fast as the default snappy on JSON payloads, files ~2.5x smaller."""
    from deltalake import WriterProperties

    return WriterProperties(compression="ZSTD", compression_level=1)


class TopicArchive:
    """One topic's Delta table and the offsets committed to it."""

    def __init__(self, lake_root: str | Path, topic: str) -> None:
        self.topic = topic
        self.path = archive_path(lake_root, topic)
        self.appender = MultiAppender(
            str(self.path), partition_by=PARTITION_BY, writer_properties=_writer_properties()
        )
        self.committed: dict[int, int] = {}  # partition -> last offset committed (known here)
        self.buffer = _Buffer()
        self.records = 0
        self.bytes = 0
        self.commits = 0

    def load(self, partitions: Iterable[int]) -> dict[int, int]:
        found = self.appender.committed_versions(app_id(self.topic, p) for p in partitions)
        self.committed = {int(a.rsplit(":", 1)[1]): v for a, v in found.items() if v is not None}
        return dict(self.committed)

    def take(self) -> _Buffer:
        """The records read so far, leaving an empty buffer to read into."""
        buf, self.buffer = self.buffer, _Buffer()
        return buf

    def commit(self, buf: _Buffer | None = None, attempts: int = 50) -> int:
        """Commit ``buf`` (default: the buffer) in one Delta commit; returns the rows written.

        Rows another writer committed meanwhile are dropped first: those the table already
        shows, and after a lost commit race (same app id), those of the winner.
        """
        if buf is None:
            buf = self.take()
        if not len(buf):
            return 0
        from deltalake.exceptions import CommitFailedError

        table = buf.table(self.topic)
        self.appender.ensure(ARCHIVE_SCHEMA)
        for _ in range(attempts):
            table = self._unwritten(table)
            if table.num_rows == 0:
                return 0
            txns = self._transactions(table)
            try:
                wrote = self.appender.append_once_many(table, transactions=txns)
            except CommitFailedError:
                wrote = False  # another writer committed one of these partitions first
            if wrote:
                for app, version in txns.items():
                    self.committed[int(app.rsplit(":", 1)[1])] = version
                self.records += table.num_rows
                self.bytes += buf.nbytes * table.num_rows // len(buf)
                self.commits += 1
                return table.num_rows
            self.appender.refresh()  # see what it wrote; drop those rows; try again
        raise ArchiveError(
            f"{self.path}: {attempts} commits in a row lost to other writers; is another "
            "archiver running on this lake?"
        )

    def _transactions(self, table: pa.Table) -> dict[str, int]:
        grouped = table.group_by("partition").aggregate([("offset", "max")])
        return {
            app_id(self.topic, p): o
            for p, o in zip(
                grouped.column("partition").to_pylist(),
                grouped.column("offset_max").to_pylist(),
                strict=True,
            )
        }

    def _unwritten(self, table: pa.Table) -> pa.Table:
        """Rows past each partition's committed version as the table knows it now."""
        parts = pc.unique(table.column("partition")).to_pylist()
        now = self.appender.committed_versions(app_id(self.topic, p) for p in parts)
        keep = None
        for app, version in now.items():
            p = int(app.rsplit(":", 1)[1])
            known = self.committed.get(p)
            if known is not None and (version is None or version < known):
                raise ArchiveError(
                    f"{self.path}: partition {p} was archived up to offset {known} and now "
                    f"the table says {version}; was the table replaced while archiving?"
                )
            if version is None or version == known:
                continue  # nothing new from another writer
            drop = pc.and_(
                pc.equal(table.column("partition"), p),
                pc.less_equal(table.column("offset"), version),
            )
            keep = pc.invert(drop) if keep is None else pc.and_(keep, pc.invert(drop))
        return table if keep is None else table.filter(keep)


# ---- the archiver ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """What one partition has to archive: ``start`` up to (excluding) ``end``."""

    start: int
    end: int | None  # None: following
    expired: int = 0  # offsets deleted by retention before they were archived


@dataclass
class CommitReport:
    """One flush: rows committed per topic and how long the flush took."""

    rows: dict[str, int]
    seconds: float

    @property
    def total(self) -> int:
        return sum(self.rows.values())


# The longest single wait on the broker's metadata: a stop is noticed between two.
_SLICE_S = 1.0


class Archiver:
    """Copies topics into their archive tables, in batches of one commit per topic.

    A batch closes at ``batch_records`` records, ``batch_bytes`` bytes or ``batch_seconds``
    after its first record, whichever comes first. Without ``follow`` the archiver stops at
    the end offsets captured by :meth:`open`.
    """

    def __init__(
        self,
        kafka: Connectable,
        topics: Sequence[str],
        lake_root: str | Path,
        *,
        follow: bool = False,
        batch_records: int = 100_000,
        batch_bytes: int = 128 * 1024 * 1024,
        batch_seconds: float = 5.0,
        timeout_s: float = 15.0,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.kafka = connection_of(kafka)
        self.stopping = stopping  # a stop asked for: metadata waits give up (``ArchiveStopped``)
        self.topics = list(dict.fromkeys(topics))
        self.lake_root = Path(lake_root)
        self.follow = follow
        self.batch_records = batch_records
        self.batch_bytes = batch_bytes
        self.batch_seconds = batch_seconds
        self.timeout_s = timeout_s
        self.tables = {t: TopicArchive(self.lake_root, t) for t in self.topics}
        self.spans: dict[tuple[str, int], Span] = {}
        self._consumer: Any = None
        self._pending: set[tuple[str, int]] = set()
        self._ends: dict[tuple[str, int], int] = {}

    # -- setup --

    def _client(self) -> Any:
        from confluent_kafka import Consumer

        fetch_total = max(52428800, self.kafka.max_fetch_bytes * 2)
        return Consumer(
            self.kafka.client_config(
                **{
                    # Never joins a group (assign, no subscribe), never commits: progress
                    # lives in the Delta tables.
                    "group.id": f"liverl-archive-{uuid.uuid4().hex[:12]}",
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "enable.partition.eof": not self.follow,
                    "auto.offset.reset": "earliest",
                    "isolation.level": "read_committed",
                    "fetch.max.bytes": fetch_total,
                    "max.partition.fetch.bytes": self.kafka.max_fetch_bytes,
                    "receive.message.max.bytes": fetch_total + 1024 * 1024,
                }
            )
        )

    def partitions(self, consumer: Any) -> dict[str, list[int]]:
        """topic -> partitions on the broker; :class:`MissingTopics` for any not there.

        The wait for the broker (up to ``timeout_s``) is asked for in slices of a second: a
        signal handler runs only between them, and one whole wait held a stop for 15 s
        with the broker gone (issue 37). ``ArchiveStopped`` once a stop was asked for."""
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                meta = consumer.list_topics(timeout=max(0.1, min(_SLICE_S, left)))
                break
            except KafkaException as exc:
                if self.stopping():
                    raise ArchiveStopped() from None
                if left <= _SLICE_S:
                    raise ArchiveError(
                        f"cannot reach Kafka at {self.kafka.bootstrap}: {exc}"
                    ) from None
        found: dict[str, list[int]] = {}
        missing = []
        for topic in self.topics:
            tmeta = meta.topics.get(topic)
            if tmeta is None or tmeta.error is not None or not tmeta.partitions:
                missing.append(topic)
            else:
                found[topic] = sorted(tmeta.partitions)
        if missing:
            raise MissingTopics(missing, self.kafka.bootstrap)
        return found

    def _watermarks(self, consumer: Any, tp: Any) -> tuple[int, int]:
        from pipeline.kafka.inspect import watermarks

        return watermarks(consumer, tp, self.timeout_s)

    def open(self) -> dict[tuple[str, int], Span]:
        """Check topics, read each partition's archived offset and assign from the next one."""
        from confluent_kafka import TopicPartition

        consumer = self._client()
        try:
            by_topic = self.partitions(consumer)
            spans: dict[tuple[str, int], Span] = {}
            for topic, parts in by_topic.items():
                done = self.tables[topic].load(parts)
                for p in parts:
                    low, high = self._watermarks(consumer, TopicPartition(topic, p))
                    start = done[p] + 1 if p in done else low
                    if start > high:
                        raise ArchiveError(
                            f"{topic}[{p}] is archived up to offset {done[p]} but the broker's "
                            f"partition ends at {high}: was the topic deleted and created "
                            f"again? Move {archive_path(self.lake_root, topic)} away to "
                            "archive it afresh."
                        )
                    expired = max(0, low - start)
                    spans[(topic, p)] = Span(
                        max(start, low), None if self.follow else high, expired
                    )
        except BaseException:
            consumer.close()
            raise
        self.spans = spans
        self._ends = {tp: s.end for tp, s in spans.items() if s.end is not None}
        self._pending = {tp for tp, s in spans.items() if s.end is not None and s.start < s.end}
        todo = [
            TopicPartition(t, p, s.start)
            for (t, p), s in spans.items()
            if self.follow or (t, p) in self._pending
        ]
        if todo:
            consumer.assign(todo)
        self._consumer = consumer
        return spans

    def _grow(self) -> None:
        """Following: start archiving partitions added to a topic since :meth:`open`."""
        from confluent_kafka import TopicPartition

        try:
            by_topic = self.partitions(self._consumer)
        except ArchiveError:
            return  # a topic deleted or the broker away: keep what is assigned
        new = []
        for topic, parts in by_topic.items():
            fresh = [p for p in parts if (topic, p) not in self.spans]
            if not fresh:
                continue
            done = self.tables[topic].load(
                sorted({p for (t, p) in self.spans if t == topic} | set(fresh))
            )
            for p in fresh:
                start = done.get(p, -1) + 1
                self.spans[(topic, p)] = Span(start, None)
                new.append(TopicPartition(topic, p, start))
        if new:
            self._consumer.incremental_assign(new)

    # -- running --

    def buffered(self) -> tuple[int, int]:
        records = sum(len(t.buffer) for t in self.tables.values())
        return records, sum(t.buffer.nbytes for t in self.tables.values())

    def take(self) -> dict[str, _Buffer]:
        return {t: sink.take() for t, sink in self.tables.items() if len(sink.buffer)}

    def commit(self, batches: dict[str, _Buffer] | None = None) -> CommitReport:
        """Commit ``batches`` (default: every buffer), one Delta commit per topic."""
        started = time.monotonic()
        batches = self.take() if batches is None else batches
        rows = {t: self.tables[t].commit(buf) for t, buf in batches.items()}
        return CommitReport({t: n for t, n in rows.items() if n}, time.monotonic() - started)

    def run(
        self,
        should_stop: Callable[[], bool] = lambda: False,
        *,
        on_read: Callable[[dict[str, int]], None] | None = None,
        on_commit: Callable[[CommitReport], None] | None = None,
        poll_s: float = 0.5,
        grow_every_s: float = 30.0,
    ) -> None:
        """Archive until done (one-shot) or ``should_stop()`` (following); commits what was
        read before returning."""
        from confluent_kafka import KafkaError, KafkaException, TopicPartition

        if self._consumer is None:
            self.open()
        consumer = self._consumer
        eof = KafkaError._PARTITION_EOF
        first_at: float | None = None
        next_grow = time.monotonic() + grow_every_s
        ends, pending, follow = self._ends, self._pending, self.follow
        tables = self.tables
        # A batch holds ~100k header lists and decoded documents: the cyclic GC would scan
        # them again and again while they pile up (~15% of the CPU). Nothing here makes
        # cycles, so collect once per commit instead, when the batch is gone.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        # One commit in flight on a thread while the next batch is read: Parquet encoding
        # and the Delta commit run in Rust without the GIL. Commits stay in order (the next
        # one starts after the previous one ended), and a commit's failure stops the run.
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archive-commit")
        in_flight: Future[CommitReport] | None = None

        def settle() -> None:
            nonlocal in_flight
            if in_flight is not None:
                report, in_flight = in_flight.result(), None
                gc.collect()
                if on_commit is not None and report.total:
                    on_commit(report)

        def flush() -> None:
            nonlocal in_flight
            settle()
            batches = self.take()
            if batches:
                in_flight = executor.submit(self.commit, batches)

        try:
            while not should_stop() and (follow or pending):
                room = self.batch_records - self.buffered()[0]
                msgs = consumer.consume(num_messages=min(10_000, max(1, room)), timeout=poll_s)
                read: dict[str, int] = {}
                finished = []
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        if err.code() == eof:
                            tp = (m.topic(), m.partition())
                            if tp in pending:
                                pending.discard(tp)
                                finished.append(TopicPartition(*tp))
                            continue
                        if err.fatal():
                            raise KafkaException(err)
                        click.echo(f"warning: {err}", err=True)
                        continue
                    topic, p, offset = m.topic(), m.partition(), m.offset()
                    if not follow:
                        end = ends[(topic, p)]
                        if offset >= end:
                            continue  # after the end captured at start: next run
                        if offset + 1 >= end and (topic, p) in pending:
                            pending.discard((topic, p))
                            finished.append(TopicPartition(topic, p))
                    buf = tables[topic].buffer
                    key, value = m.key(), m.value()
                    ts_type, ts = m.timestamp()
                    buf.partitions.append(p)
                    buf.offsets.append(offset)
                    buf.timestamps.append(ts if ts_type else None)
                    buf.keys.append(key)
                    buf.headers.append(m.headers())
                    buf.values.append(value)
                    buf.nbytes += (len(value) if value else 0) + (len(key) if key else 0)
                    read[topic] = read.get(topic, 0) + 1
                if finished:
                    consumer.pause(finished)
                if read:
                    if first_at is None:
                        first_at = time.monotonic()
                    if on_read is not None:
                        on_read(read)
                records, nbytes = self.buffered()
                due = first_at is not None and (
                    records >= self.batch_records
                    or nbytes >= self.batch_bytes
                    or time.monotonic() - first_at >= self.batch_seconds
                )
                if due:
                    flush()
                    first_at = None
                elif in_flight is not None and in_flight.done():
                    settle()
                if follow and time.monotonic() >= next_grow:
                    settle()  # _grow reloads committed offsets
                    self._grow()
                    next_grow = time.monotonic() + grow_every_s
            flush()
            settle()
        finally:
            executor.shutdown(wait=True)  # a commit under way ends (atomically) either way
            if gc_was_enabled:
                gc.enable()
            self.close()

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()  # nothing was ever stored or committed
            self._consumer = None
