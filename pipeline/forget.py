"""``liverl forget --session S | --user U``: remove one session's, or one user's, data from
everywhere liverl keeps it, and record that it did (docs/architecture.md#data-retention-and-
forgetting).

A user is the interaction's ``user_id`` (``X-Liverl-User``, else the caller's key id, filled by
the gateway); ``--user`` finds the user's sessions in the archive's interaction tables, in the
interactions topic and in the gateway spools, then forgets each session. Per place:

- **Delta**: every table of the lake (and of replay namespaces' lakes) with a ``session_id``
  column: the partitions holding the sessions' rows are written again without them (one
  overwrite commit per table, see :func:`delete_rows` for why not ``DeltaTable.delete``), a
  checkpoint, then a vacuum of the files removed at least ``vacuum_retention_hours`` ago
  (``--vacuum-now``: zero). The vacuum runs in delta-rs' lite
  mode: it only ever deletes files the log removed, never a concurrent writer's uncommitted
  ones, so it is safe next to a running trainer and archiver; the retention protects readers
  of older table versions (time travel, a running offline retraining).
- **Trainer version folders** (``vN/trainer/trajectories.parquet``, the rows kept so that a
  restart can finish publishing): rewritten without the rows, the manifest's sha256 updated.
- **Faust changelog topics** ``<app_id>-<table>-changelog`` (compacted, keyed by session):
  a tombstone for each of the session's keys whose latest value is not one already.
- **Gateway spools**: segments are rewritten only under the spool's lock taken exclusively, so
  never under a running gateway; a live spool still holding undelivered frames of the
  session is a refusal (they are about to reach Kafka); delivered frames in a live spool stay
  until the gateway deletes their segment, and the output and the log say so.
- **Kafka topics** (``cleanup.policy=delete``) cannot delete by key: their retention is the
  bound, which forget reports per topic from the records it saw.

Each run that changes something appends one row to the ``forget_log`` Delta table: who, when,
the session ids, a sha256 of the user id (never the id itself) and counts per place, never
content. ``--dry-run`` prints the same survey and changes nothing, the log included.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import os
import re
import socket
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import orjson
import pyarrow as pa
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline import __version__
from pipeline.errors import ForgetError
from pipeline.kafka import names
from pipeline.settings import Settings

FORGET_LOG = "forget_log"
FORGET_LOG_SCHEMA = pa.schema(
    [
        ("forget_id", pa.string()),
        ("ts_ms", pa.int64()),
        ("operator", pa.string()),  # who ran it: OS user@host
        ("target", pa.string()),  # session | user
        ("user_sha256", pa.string()),  # --user only: a hash, the id itself is not kept
        ("sessions", pa.list_(pa.string())),  # not "session_id": a later forget keeps the log
        ("removed", pa.string()),  # JSON counts per place (delta, changelogs, spools, versions)
        ("kept", pa.string()),  # JSON: what only time removes (Kafka retention, live spools)
        ("vacuum_retention_hours", pa.int64()),
        ("vacuumed_files", pa.int64()),
        ("liverl_version", pa.string()),
    ]
)
MAX_ID_CHARS = 256
# Kafka's default segment.ms (log.roll.hours = 168): a record is deleted with its segment, so
# it can outlive retention.ms by up to this when the spec does not set segment.ms.
DEFAULT_SEGMENT_MS = 7 * 24 * 3_600_000
_FRAME_HEAD = 8  # spool frames: >II (length, crc32) then the payload
_COMMIT_ATTEMPTS = 8


class ForgetSettings(BaseSettings):
    """``LIVERL_FORGET_*``: the lake's retention policy for deleted files."""

    model_config = SettingsConfigDict(env_prefix="LIVERL_FORGET_", extra="ignore")

    # Files a forget removed from a Delta table are physically deleted by the first vacuum
    # at least this long afterwards (every `liverl forget`, or `liverl forget --vacuum-only`
    # from cron); older table versions stay readable for this long.
    vacuum_retention_hours: int = Field(default=24, ge=0)


# ---- what was found --------------------------------------------------------------------------


@dataclass
class DeltaHit:
    label: str  # table path under its lake (replay lakes: replay/NAME/<table>)
    path: Path
    rows: int
    archive: bool  # an archive table: dead letters and tombstones match by Kafka key
    newest_ms: dict[str, int] = field(default_factory=dict)  # archive: topic -> newest record


@dataclass
class ChangelogHit:
    topic: str
    keys: list[tuple[int, bytes]]  # (partition, key) whose latest value is not a tombstone
    touched_ms: int = 0  # newest touched_ms among the session states (0: unknown)


@dataclass
class SpoolHit:
    path: Path
    pending: int  # frames not yet delivered to Kafka
    delivered: int  # delivered frames whose segment is still on disk
    quarantined: list[Path]  # damaged regions that name the session
    live: bool  # a gateway holds the spool


@dataclass
class VersionHit:
    folder: Path
    rows: int


@dataclass
class Survey:
    target: str
    value: str
    sessions: list[str]
    delta: list[DeltaHit] = field(default_factory=list)
    changelogs: list[ChangelogHit] = field(default_factory=list)
    spools: list[SpoolHit] = field(default_factory=list)
    versions: list[VersionHit] = field(default_factory=list)
    kafka: dict[str, tuple[int, int]] = field(default_factory=dict)  # topic -> (records, newest)
    notes: list[str] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(
            any(h.rows for h in self.delta)
            or any(h.keys for h in self.changelogs)
            or any(h.pending or h.delivered or h.quarantined for h in self.spools)
            or any(h.rows for h in self.versions)
            or any(n for n, _ in self.kafka.values())
        )


# ---- places ----------------------------------------------------------------------------------


def lakes(settings: Settings, lake: Path) -> list[tuple[str, Path]]:
    """(label prefix, root) of the lake and of every replay namespace's lake."""
    out = [("", Path(lake))]
    for root in sorted((Path(settings.state_dir) / "replay").glob("*/lake")):
        if root.resolve() != Path(lake).resolve():
            out.append((f"replay/{root.parent.name}/", root))
    return out


def weights_roots(settings: Settings) -> list[Path]:
    main = Path(settings.trainer.under_state_dir(settings.state_dir).weights_root)
    return [main, *sorted((Path(settings.state_dir) / "replay").glob("*/weights"))]


def spool_dirs(settings: Settings, extra: Iterable[Path] = ()) -> list[Path]:
    """Gateway spools: ``--spool-dir``, a configured ``serve.spool_dir`` and every folder of
    ``<state_dir>/spool/`` (``liverl serve`` uses ``<state_dir>/spool/<replica_id>``)."""
    from pipeline.serving.settings import ServeSettings

    found: list[Path] = list(extra)
    if settings.serve.spool_dir != ServeSettings().spool_dir:
        found.append(Path(settings.serve.spool_dir))
    base = Path(settings.state_dir) / "spool"
    if base.is_dir():
        found += [base, *sorted(p for p in base.iterdir() if p.is_dir())]
    out: dict[Path, Path] = {}
    for p in found:
        if p.is_dir() and (any(p.glob("*.log")) or (p / "quarantine").is_dir()):
            out.setdefault(p.resolve(), p)
    return list(out.values())


# ---- Kafka -----------------------------------------------------------------------------------


def _consumer(settings: Settings) -> Any:
    from confluent_kafka import Consumer

    fetch = settings.kafka.max_fetch_bytes
    return Consumer(
        settings.kafka_client_config(
            **{
                # assign only, never commits: forget leaves no consumer group behind
                "group.id": f"liverl-forget-{uuid.uuid4().hex[:12]}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                "max.partition.fetch.bytes": fetch,
                "fetch.max.bytes": max(52428800, fetch * 2),
                "receive.message.max.bytes": max(52428800, fetch * 2) + 1024 * 1024,
            }
        )
    )


def broker_topics(settings: Settings, timeout_s: float = 15.0) -> set[str]:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        meta = AdminClient(settings.kafka_client_config()).list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise ForgetError(f"cannot reach Kafka at {settings.bootstrap}: {exc}") from None
    return {t for t, m in meta.topics.items() if m.error is None}


def scan_topics(
    settings: Settings,
    topics: Iterable[str],
    handle: Callable[[Any], None],
    idle_timeout_s: float = 30.0,
) -> None:
    """Every record of ``topics`` from the low to the high watermark captured at start."""
    from confluent_kafka import KafkaError, TopicPartition

    consumer = _consumer(settings)
    try:
        todo: list[Any] = []
        ends: dict[tuple[str, int], int] = {}
        for topic in topics:
            meta = consumer.list_topics(topic, timeout=idle_timeout_s).topics.get(topic)
            if meta is None or meta.error is not None:
                continue
            for p in sorted(meta.partitions):
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, p), timeout=idle_timeout_s
                )
                if high > low:
                    todo.append(TopicPartition(topic, p, low))
                    ends[(topic, p)] = high
        if not todo:
            return
        consumer.assign(todo)
        pending = set(ends)
        last_progress = time.monotonic()
        while pending:
            msgs = consumer.consume(num_messages=1000, timeout=0.5)
            if not msgs and time.monotonic() - last_progress > idle_timeout_s:
                left = ", ".join(f"{t}[{p}]" for t, p in sorted(pending))
                raise ForgetError(f"reading {left} stalled for {idle_timeout_s:.0f}s")
            for m in msgs:
                last_progress = time.monotonic()
                tp = (m.topic(), m.partition())
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(tp)
                        continue
                    raise ForgetError(f"reading {tp[0]}[{tp[1]}]: {err}")
                if tp not in pending:
                    continue
                if m.offset() < ends[tp]:
                    handle(m)
                if m.offset() + 1 >= ends[tp]:
                    pending.discard(tp)
    finally:
        consumer.close()


def changelog_topics(settings: Settings, present: set[str]) -> dict[str, str]:
    """changelog topic -> table name, for the processors' app id (live and replay namespaces):
    Faust names a table's changelog ``<app_id>-<table>-changelog``."""
    app_id = re.escape(settings.processors.app_id)
    pattern = re.compile(
        rf"^(?:{re.escape(names.NAMESPACE_PREFIX)}[A-Za-z0-9_-]+\.)?{app_id}-(.+)-changelog$"
    )
    return {t: m[1] for t in sorted(present) if (m := pattern.match(t))}


def session_of_key(table: str, key: bytes) -> bytes | None:
    """The session a changelog key belongs to (processors/app.py): ``session`` (sessions,
    judging), ``session\\0turn`` (tokens), ``session\\0id`` (parked, judge_parked),
    ``group\\0session`` (group_members). ``groups`` (group id -> member ids) holds no content
    and is left alone."""
    if table == "groups":
        return None
    if table == "group_members":
        return key.split(b"\0", 1)[1] if b"\0" in key else None
    return key.split(b"\0", 1)[0]


def survey_changelogs(
    settings: Settings, sessions: list[str], present: set[str]
) -> list[ChangelogHit]:
    wanted = {s.encode() for s in sessions}
    tables = changelog_topics(settings, present)
    latest: dict[tuple[str, int, bytes], bytes | None] = {}

    def handle(m: Any) -> None:
        key = m.key()
        if key is None:
            return
        sid = session_of_key(tables[m.topic()], key)
        if sid in wanted:
            latest[(m.topic(), m.partition(), key)] = m.value()

    scan_topics(settings, tables, handle)
    hits: dict[str, ChangelogHit] = {t: ChangelogHit(t, []) for t in tables}
    for (topic, partition, key), value in sorted(latest.items()):
        if value is None:
            continue  # already a tombstone
        hit = hits[topic]
        hit.keys.append((partition, key))
        if tables[topic] in ("sessions", "judging"):
            with contextlib.suppress(Exception):
                hit.touched_ms = max(hit.touched_ms, int(orjson.loads(value)["touched_ms"]))
    return [h for h in hits.values() if h.keys]


def tombstone(settings: Settings, hits: list[ChangelogHit], timeout_s: float = 30.0) -> int:
    """A null value for each key, on the partition where its values are: compaction then
    drops the values, and a worker recovering the table no longer sees the session."""
    from confluent_kafka import Producer

    producer = Producer(
        settings.kafka_client_config(**{"enable.idempotence": True, "acks": "all"})
    )
    errors: list[str] = []

    def delivered(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(f"{msg.topic()}[{msg.partition()}]: {err}")

    sent = 0
    for hit in hits:
        for partition, key in hit.keys:
            producer.produce(hit.topic, key=key, value=None, partition=partition,
                             on_delivery=delivered)
            producer.poll(0)
            sent += 1
    left = producer.flush(timeout_s)
    if left or errors:
        raise ForgetError(
            f"{left + len(errors)} of {sent} changelog tombstones were not delivered "
            f"({'; '.join(errors[:3]) or 'timeout'}); run forget again"
        )
    return sent


def interaction_topics(settings: Settings, present: set[str]) -> list[str]:
    """The interactions topic and its copies in replay namespaces (kept until dropped)."""
    live = settings.serve.interactions_topic
    topic = names.resolve(live, settings.kafka.namespace)
    copies = [t for t in sorted(present)
              if (ns := names.namespace_of(t)) and names.live(t, ns) == live and t != topic]
    return [t for t in (topic, *copies) if t in present]


def scan_interactions(
    settings: Settings, topics: list[str], sessions: set[str], user: str | None
) -> tuple[set[str], dict[str, tuple[int, int]]]:
    """Sessions of ``user`` on the interactions topics, and per topic (records, newest
    timestamp) of those sessions (``sessions`` plus the user's)."""
    needle = orjson.dumps(user) if user is not None else None
    counts: dict[tuple[str, str], list[int]] = {}

    def handle(m: Any) -> None:
        key, value = m.key(), m.value()
        sid = key.decode("utf-8", "replace") if key else None
        if needle is not None and value and needle in value:
            with contextlib.suppress(Exception):
                doc = orjson.loads(value)
                if doc.get("user_id") == user and isinstance(doc.get("session_id"), str):
                    sid = doc["session_id"]
                    sessions.add(sid)
        if sid is not None:
            c = counts.setdefault((m.topic(), sid), [0, 0])
            c[0] += 1
            c[1] = max(c[1], m.timestamp()[1])

    scan_topics(settings, topics, handle)
    out: dict[str, tuple[int, int]] = {}
    for topic in topics:
        mine = [c for (t, sid), c in counts.items() if t == topic and sid in sessions]
        out[topic] = (sum(c[0] for c in mine), max((c[1] for c in mine), default=0))
    return sessions, out


# ---- Delta -----------------------------------------------------------------------------------


def _sql_literal(value: Any) -> str:
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ForgetError(f"cannot write a predicate on partition value {value!r}")
    return str(value)


def partition_predicate(columns: list[str], values: Iterable[tuple[Any, ...]]) -> str:
    """SQL selecting whole partitions: Delta removes their files without rewriting any."""
    terms = []
    for combo in sorted(set(values), key=repr):
        parts = [
            f"{c} IS NULL" if v is None else f"{c} = {_sql_literal(v)}"
            for c, v in zip(columns, combo, strict=True)
        ]
        terms.append("(" + " AND ".join(parts) + ")")
    return " OR ".join(terms)


def _is_archive(schema: pa.Schema) -> bool:
    return "key" in schema.names and pa.types.is_binary(schema.field("key").type)


def session_mask(batch: pa.RecordBatch | pa.Table, sessions: list[str], archive: bool) -> Any:
    """Rows of the sessions; in archive tables also those with no decoded session (dead
    letters, tombstones) whose Kafka key is a session id. Computed in memory: a dataset filter
    on a string column fails on files delta-rs wrote with view types (see delete_rows)."""
    import pyarrow.compute as pc

    sid = batch.column("session_id")
    mask = pc.fill_null(pc.is_in(sid, value_set=pa.array(sessions, pa.string())), False)
    if archive:
        keys = pa.array([s.encode() for s in sessions], pa.binary())
        in_keys = pc.fill_null(pc.is_in(batch.column("key"), value_set=keys), False)
        mask = pc.or_(mask, pc.and_(pc.is_null(sid), in_keys))
    return mask


def session_tables(root: Path) -> dict[str, Path]:
    """Tables under ``root`` with a ``session_id`` column (the log excluded), by label."""
    from pipeline.lake.reading import dataset as delta_dataset
    from pipeline.lake.sql import find_tables

    out: dict[str, Path] = {}
    for path in find_tables(root).values():
        label = path.relative_to(root).as_posix()
        if label == FORGET_LOG:
            continue
        schema = delta_dataset(path).schema
        if "session_id" in schema.names:
            out[label] = path
    return out


def _matches(path: Path, sessions: list[str], extra: list[str]) -> tuple[pa.Table, bool]:
    """The sessions' rows of a table: ``session_id`` (and ``key``) plus the ``extra`` columns
    the table has; and whether it is an archive table."""
    from pipeline.lake.reading import dataset as delta_dataset

    dataset = delta_dataset(path)
    archive = _is_archive(dataset.schema)
    names_ = ["session_id", *(["key"] if archive else []), *extra]
    cols = [c for c in dict.fromkeys(names_) if c in dataset.schema.names]
    schema = pa.schema([dataset.schema.field(c) for c in cols])
    found = [
        batch.filter(session_mask(batch, sessions, archive))
        for batch in dataset.scanner(columns=cols).to_batches()
        if batch.num_rows
    ]
    return pa.Table.from_batches(found, schema=schema), archive


def survey_delta(settings: Settings, lake: Path, sessions: list[str]) -> list[DeltaHit]:
    hits = []
    for prefix, root in lakes(settings, lake):
        for label, path in session_tables(root).items():
            rows, archive = _matches(path, sessions, ["topic", "timestamp_ms"])
            hit = DeltaHit(prefix + label, path, rows.num_rows, archive)
            if {"topic", "timestamp_ms"} <= set(rows.column_names) and rows.num_rows:
                newest = rows.group_by("topic").aggregate([("timestamp_ms", "max")])
                hit.newest_ms = dict(
                    zip(newest["topic"].to_pylist(), newest["timestamp_ms_max"].to_pylist(),
                        strict=True)
                )
            hits.append(hit)
    return hits


def archive_sessions_of(settings: Settings, lake: Path, user: str) -> set[str]:
    """Sessions whose archived interactions carry ``user_id == user`` (every archive table of
    every lake holding ``interaction`` events; the payload is read, since the archive keeps
    no user column)."""
    from pipeline.lake.reading import dataset as delta_dataset

    needle = orjson.dumps(user)
    found: set[str] = set()
    for _prefix, root in lakes(settings, lake):
        for path in session_tables(root).values():
            dataset = delta_dataset(path)
            if not {"event_type", "payload"} <= set(dataset.schema.names):
                continue
            scanner = dataset.scanner(columns=["event_type", "session_id", "payload"])
            for batch in scanner.to_batches():
                rows = zip(batch.column("event_type").to_pylist(),
                           batch.column("session_id").to_pylist(),
                           batch.column("payload").to_pylist(), strict=True)
                for kind, sid, raw in rows:
                    if kind != "interaction" or sid is None or raw is None or needle not in raw:
                        continue
                    with contextlib.suppress(Exception):
                        if orjson.loads(raw).get("user_id") == user:
                            found.add(sid)
    return found


def _partition_filter(columns: list[str], combos: Iterable[tuple[Any, ...]]) -> Any:
    import pyarrow.dataset as ds

    expr = None
    for combo in set(combos):
        term = None
        for c, v in zip(columns, combo, strict=True):
            t = ds.field(c).is_null() if v is None else ds.field(c) == v
            term = t if term is None else term & t
        expr = term if expr is None else expr | term
    return expr


def _without(
    batches: Iterable[pa.RecordBatch], sessions: list[str], archive: bool, removed: list[int]
) -> Iterator[pa.RecordBatch]:
    """The batches minus the sessions' rows, counting those in ``removed[0]``."""
    import pyarrow.compute as pc

    for batch in batches:
        mask = session_mask(batch, sessions, archive)
        removed[0] += pc.sum(mask).as_py() or 0
        yield batch.filter(pc.invert(mask))


def delete_rows(hit: DeltaHit, sessions: list[str]) -> int:
    """Remove the sessions' rows; returns how many. Each partition holding some is written
    again without them, in one overwrite commit (retried when it races a concurrent writer).

    Not ``DeltaTable.delete``: the files it rewrites carry Arrow view types (delta-rs 1.6),
    after which every filtered read of the table through pyarrow (``liverl sql ... WHERE
    session_id = ...``, the archive's readers) fails with "no kernel matching input types
    (string, string_view)". An overwrite whose predicate names partitions only removes whole
    files, so every file of the table keeps coming from ``write_deltalake``."""
    from deltalake import DeltaTable, write_deltalake
    from deltalake.exceptions import CommitFailedError

    from pipeline.lake.reading import dataset as delta_dataset

    for attempt in range(_COMMIT_ATTEMPTS):
        table = DeltaTable(str(hit.path))
        parts = list(table.metadata().partition_columns)
        found, archive = _matches(hit.path, sessions, parts)
        if not found.num_rows:
            return 0
        combos = list(zip(*(found.column(c).to_pylist() for c in parts), strict=True))
        dataset = delta_dataset(table)
        scanner = dataset.scanner(filter=_partition_filter(parts, combos) if parts else None)
        removed = [0]
        kept = _without(scanner.to_batches(), sessions, archive, removed)
        reader = pa.RecordBatchReader.from_batches(dataset.schema, kept)
        try:
            write_deltalake(
                str(hit.path), reader, mode="overwrite",
                predicate=partition_predicate(parts, combos) if parts else None,
            )
        except CommitFailedError as exc:
            if attempt == _COMMIT_ATTEMPTS - 1:
                where = partition_predicate(parts, combos) if parts else "the table"
                raise ForgetError(
                    f"{hit.path}: {_COMMIT_ATTEMPTS} commits lost to concurrent writers "
                    f"appending to {where} ({exc}); run forget again, or pause the writer "
                    "(liverl archive, the trainer) for a moment"
                ) from None
            continue
        # A checkpoint lets the log cleanup (delta.logRetentionDuration) drop the commits
        # whose statistics still name the removed rows' values.
        DeltaTable(str(hit.path)).create_checkpoint()
        DeltaTable(str(hit.path)).cleanup_metadata()
        return removed[0]
    return 0  # pragma: no cover - the loop returns or raises


def vacuum(paths: Iterable[Path], retention_hours: int) -> int:
    """Lite vacuum (only files the log removed, never untracked ones a concurrent writer is
    about to commit) of files removed at least ``retention_hours`` ago; returns files deleted."""
    from deltalake import DeltaTable

    removed = 0
    for path in paths:
        removed += len(
            DeltaTable(str(path)).vacuum(
                retention_hours=retention_hours,
                dry_run=False,
                enforce_retention_duration=False,
                full=False,
            )
        )
    return removed


def write_log(lake: Path, row: dict[str, Any]) -> None:
    from deltalake import write_deltalake

    write_deltalake(
        str(Path(lake) / FORGET_LOG),
        pa.Table.from_pylist([row], schema=FORGET_LOG_SCHEMA),
        mode="append",
    )


# ---- trainer version folders -----------------------------------------------------------------


def _trajectory_files(settings: Settings) -> Iterator[Path]:
    from pipeline.trainer import checkpoint as ck
    from pipeline.trainer.publish import TRAJ_FILE

    for root in weights_roots(settings):
        if not root.is_dir():
            continue
        for policy in sorted(p.name for p in root.iterdir() if p.is_dir()):
            for v in ck.versions(root, policy):
                f = ck.version_dir(root, policy, v) / ck.TRAINER_DIR / TRAJ_FILE
                if f.is_file():
                    yield f


def survey_versions(settings: Settings, sessions: list[str]) -> list[VersionHit]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    hits = []
    wanted = pa.array(sessions, pa.string())
    for f in _trajectory_files(settings):
        col = pq.read_table(f, columns=["session_id"]).column("session_id")
        n = pc.sum(pc.is_in(col, value_set=wanted)).as_py() or 0
        if n:
            hits.append(VersionHit(f.parent.parent, int(n)))
    return hits


def rewrite_version(hit: VersionHit, sessions: list[str]) -> int:
    """The folder's trajectory rows without the sessions; the manifest follows the new file.

    Two renames (rows, then manifest): a trainer starting between them would take this version
    as corrupt, so folders are rewritten oldest first and only those holding the sessions."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline.durable import atomic_write, replacing, sha256_file
    from pipeline.trainer import checkpoint as ck
    from pipeline.trainer.publish import TRAJ_FILE

    f = hit.folder / ck.TRAINER_DIR / TRAJ_FILE
    table = pq.read_table(f)
    drop = pc.is_in(table.column("session_id"), value_set=pa.array(sessions, pa.string()))
    keep = table.filter(pc.invert(pc.fill_null(drop, False)))
    manifest = ck.Manifest.from_json((hit.folder / ck.MANIFEST).read_bytes())
    rel = f.relative_to(hit.folder).as_posix()
    with replacing(f) as tmp:
        pq.write_table(keep, tmp)
        for entry in manifest.trainer_files:
            if entry["path"] == rel:
                entry["sha256"], entry["bytes"] = sha256_file(tmp), tmp.stat().st_size
    atomic_write(hit.folder / ck.MANIFEST, manifest.to_json())
    return table.num_rows - keep.num_rows


# ---- gateway spools --------------------------------------------------------------------------


def _frames(data: bytes) -> Iterator[tuple[int, int, bytes | None]]:
    """(start, end, payload) of each whole frame of a segment; a damaged region ends the walk
    as one (start, len, None): what follows it is kept unexamined."""
    pos = 0
    while pos < len(data):
        ok = len(data) - pos >= _FRAME_HEAD
        if ok:
            length = int.from_bytes(data[pos : pos + 4], "big")
            crc = int.from_bytes(data[pos + 4 : pos + 8], "big")
            end = pos + _FRAME_HEAD + length
            ok = length > 0 and end <= len(data)
            ok = ok and zlib.crc32(memoryview(data)[pos + _FRAME_HEAD : end]) == crc
        if not ok:
            yield pos, len(data), None
            return
        yield pos, end, data[pos + _FRAME_HEAD : end]
        pos = end


def _frame_session(payload: bytes) -> tuple[str, str | None, bytes]:
    """(topic, session, value) of a spool frame (recorder.frame): the key, or the value's
    ``session_id`` for a keyless record."""
    from pipeline.serving.recorder import unframe

    topic, key, value, _ = unframe(payload)
    if key is not None:
        return topic, key.decode("utf-8", "replace"), value
    sid = None
    with contextlib.suppress(Exception):
        got = orjson.loads(value).get("session_id")
        sid = got if isinstance(got, str) else None
    return topic, sid, value


def _cursor(spool: Path) -> tuple[int, int]:
    """(segment, byte offset) of the first undelivered frame (spool.py's acked.json)."""
    try:
        raw = orjson.loads((spool / "acked.json").read_bytes())
        return int(raw["segment"]), int(raw["offset"])
    except FileNotFoundError:
        return -1, 0  # nothing acknowledged: every frame is pending


def _segments(spool: Path) -> list[tuple[int, Path]]:
    return sorted((int(p.stem), p) for p in spool.glob("*.log") if p.stem.isdigit())


def spool_user_sessions(spool: Path, topic: str, user: str) -> set[str]:
    needle = orjson.dumps(user)
    found: set[str] = set()
    for _first, seg in _segments(spool):
        for _s, _e, payload in _frames(seg.read_bytes()):
            if payload is None:
                continue
            with contextlib.suppress(Exception):  # the value is escaped inside the frame
                t, sid, value = _frame_session(payload)
                if t == topic and sid is not None and needle in value \
                        and orjson.loads(value).get("user_id") == user:
                    found.add(sid)
    return found


def _quarantined(spool: Path, sessions: list[str]) -> list[Path]:
    from pipeline.serving.spool import QUARANTINE_DIR

    marks = [b'"k":' + orjson.dumps(s) for s in sessions]
    out = []
    for bad in sorted((spool / QUARANTINE_DIR).glob("*.bad")):
        with contextlib.suppress(OSError):
            data = bad.read_bytes()
            if any(m in data for m in marks):
                out.append(bad)
    return out


def survey_spool(spool: Path, sessions: list[str], live: bool) -> SpoolHit:
    wanted = set(sessions)
    cur_seg, cur_off = _cursor(spool)
    pending = delivered = 0
    for first, seg in _segments(spool):
        for _start, end, payload in _frames(seg.read_bytes()):
            if payload is None:
                continue
            with contextlib.suppress(Exception):
                if _frame_session(payload)[1] in wanted:
                    if first < cur_seg or (first == cur_seg and end <= cur_off):
                        delivered += 1
                    else:
                        pending += 1
    return SpoolHit(spool, pending, delivered, _quarantined(spool, sessions), live)


def rewrite_spool(hit: SpoolHit, sessions: list[str]) -> int:
    """Drop the sessions' undelivered frames and blank their delivered ones; call with the
    spool's lock held exclusively (no gateway running on it).

    Delivered frames keep their length, replaced by a frame of spaces with a valid crc, so
    the byte offset of the acknowledged position stays right and a segment's frame count is
    unchanged; undelivered frames are removed, so they are never sent. Each segment is
    replaced atomically (temp file, fsync, rename), so a crash leaves it old or new."""
    from pipeline.durable import atomic_write, fsync_path

    wanted = set(sessions)
    cur_seg, cur_off = _cursor(hit.path)
    changed = 0
    for first, seg in _segments(hit.path):
        data = seg.read_bytes()
        out = bytearray()
        touched = 0
        for start, end, payload in _frames(data):
            session = None
            if payload is not None:
                with contextlib.suppress(Exception):
                    session = _frame_session(payload)[1]
            if payload is None or session not in wanted:
                out += data[start:end]
                continue
            touched += 1
            if first < cur_seg or (first == cur_seg and end <= cur_off):
                blank = b" " * len(payload)
                out += len(blank).to_bytes(4, "big") + zlib.crc32(blank).to_bytes(4, "big")
                out += blank
        if not touched:
            continue
        atomic_write(seg, bytes(out), sync_folder=False)  # one folder fsync at the end
        changed += touched
    for bad in hit.quarantined:
        bad.unlink(missing_ok=True)
    fsync_path(hit.path)
    return changed


@contextlib.contextmanager
def spool_locks(dirs: list[Path]) -> Iterator[dict[Path, bool]]:
    """Try each spool's lock exclusively: path -> True when a gateway holds it (live)."""
    from pipeline.serving.spool import LOCK_FILE

    fds: list[int] = []
    live: dict[Path, bool] = {}
    try:
        for d in dirs:
            fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                live[d] = True
                continue
            fds.append(fd)
            live[d] = False
        yield live
    finally:
        for fd in fds:
            os.close(fd)


# ---- the survey and the run ------------------------------------------------------------------


def _retention(settings: Settings) -> dict[str, tuple[int, int]]:
    """topic -> (retention.ms, segment.ms) from topics/ (-1: kept forever)."""
    from pipeline.kafka.topics import load_specs

    out = {}
    with contextlib.suppress(Exception):
        for spec in load_specs(settings.topics.specs_dir):
            cfg = spec.config
            out[spec.name] = (
                int(cfg.get("retention.ms", 604_800_000)),
                int(cfg.get("segment.ms", DEFAULT_SEGMENT_MS)),
            )
    return out


def kafka_kept(settings: Settings, s: Survey) -> dict[str, dict[str, Any]]:
    """Per topic holding the sessions' records: how many (when known) and the time by which
    retention has deleted them (newest record + retention.ms + segment.ms)."""
    newest: dict[str, int] = {}
    records: dict[str, int] = {}
    for hit in s.delta:
        for topic, ts in hit.newest_ms.items():
            newest[topic] = max(newest.get(topic, 0), ts or 0)
    for topic, (n, ts) in s.kafka.items():
        if n:
            newest[topic] = max(newest.get(topic, 0), ts)
            records[topic] = n
    specs = _retention(settings)
    out: dict[str, dict[str, Any]] = {}
    for topic, ts in sorted(newest.items()):
        ns = names.namespace_of(topic)
        retention, segment = specs.get(names.live(topic, ns), (604_800_000, DEFAULT_SEGMENT_MS))
        if ns:
            retention = -1  # replay namespaces keep everything (docs: Replay and namespaces)
        entry: dict[str, Any] = {"retention_ms": retention}
        if topic in records:
            entry["records"] = records[topic]
        if ns:
            entry["gone_by"] = f"never: `liverl drop-namespace {ns}` deletes it"
        elif retention < 0:
            entry["gone_by"] = "never (retention.ms -1)"
        else:
            end = (ts + retention + segment) / 1000
            entry["gone_by"] = datetime.fromtimestamp(end, UTC).isoformat(timespec="seconds")
        out[topic] = entry
    return out


def resolve_sessions(
    settings: Settings, lake: Path, spools: list[Path], user: str, topics: list[str]
) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """The user's sessions from the archive, the spools and the interactions topics, and per
    topic (records, newest timestamp) of those sessions."""
    found = archive_sessions_of(settings, lake, user)
    topic = names.resolve(settings.serve.interactions_topic, settings.kafka.namespace)
    for spool in spools:
        found |= spool_user_sessions(spool, topic, user)
    found, kafka = scan_interactions(settings, topics, found, user)
    return sorted(found), kafka


def survey(
    settings: Settings,
    lake: Path,
    target: str,
    value: str,
    spools: list[Path],
    live: dict[Path, bool],
) -> Survey:
    present = broker_topics(settings)
    topics = interaction_topics(settings, present)
    if target == "user":
        sessions, kafka = resolve_sessions(settings, lake, spools, value, topics)
    else:
        sessions = [value]
        kafka = scan_interactions(settings, topics, {value}, None)[1]
    s = Survey(target, value, sessions, kafka=kafka)
    if not sessions:
        return s
    s.delta = survey_delta(settings, lake, sessions)
    s.changelogs = survey_changelogs(settings, sessions, present)
    s.spools = [survey_spool(p, sessions, live.get(p, False)) for p in spools]
    s.versions = survey_versions(settings, sessions)
    now = time.time() * 1000
    retain_ms = settings.processors.retain_s * 1000
    for hit in s.changelogs:
        if hit.touched_ms and now - hit.touched_ms < retain_ms:
            s.notes.append(
                f"{hit.topic}: the session's state changed {(now - hit.touched_ms) / 60000:.0f} "
                "min ago; a running worker keeps it in memory until it expires "
                f"(processors.retain_s = {settings.processors.retain_s:g} s) and would write it "
                "back if the session went on: run forget again after that, or restart the "
                "workers now"
            )
    return s


def operator() -> str:
    try:
        who = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in a container
        who = f"uid{os.getuid()}"
    return f"{who}@{socket.gethostname()}"


def _echo_survey(s: Survey, dry_run: bool) -> None:
    what = f"session {s.value}" if s.target == "session" else f"user {s.value}"
    click.echo(f"forget {what}: {len(s.sessions)} session(s)"
               + (" (dry run: nothing is changed)" if dry_run else ""))
    for sid in s.sessions:
        click.echo(f"  session {sid}")
    verb = "would remove" if dry_run else "removing"
    for d in s.delta:
        if d.rows:
            click.echo(f"  delta      {d.label}: {verb} {d.rows} row(s)")
    for v in s.versions:
        click.echo(f"  weights    {v.folder}: {verb} {v.rows} trajectory row(s)")
    for c in s.changelogs:
        click.echo(f"  changelog  {c.topic}: {verb} {len(c.keys)} key(s) (tombstones)")
    for sp in s.spools:
        if sp.live:
            if sp.pending:
                click.echo(f"  spool      {sp.path}: {sp.pending} undelivered frame(s) held by a "
                           "running gateway: a forget is refused until they are delivered")
            if sp.delivered:
                click.echo(f"  spool      {sp.path}: {sp.delivered} delivered frame(s) kept: a "
                           "gateway holds this spool (they go with their segment)")
            continue
        if sp.pending or sp.delivered or sp.quarantined:
            click.echo(f"  spool      {sp.path}: {verb} {sp.pending} undelivered and blanking "
                       f"{sp.delivered} delivered frame(s), {len(sp.quarantined)} quarantine "
                       "file(s)")
    for note in s.notes:
        click.echo(f"  note: {note}")


@click.command("forget")
@click.option("--session", "session_id", default=None, metavar="S", help="Forget this session.")
@click.option("--user", "user_id", default=None, metavar="U",
              help="Forget every session whose interactions carry user_id U (X-Liverl-User, "
              "else the API key's id).")
@click.option("--dry-run", is_flag=True, help="Print what would be removed; change nothing.")
@click.option("--vacuum-now", is_flag=True,
              help="Vacuum with zero retention: the files are gone now, and so is every older "
              "version of the tables (time travel, a running offline retraining).")
@click.option("--vacuum-only", is_flag=True,
              help="Forget nothing: vacuum the files forgets removed at least "
              "LIVERL_FORGET_VACUUM_RETENTION_HOURS ago (run it daily).")
@click.option("--spool-dir", "spool_dir", multiple=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A gateway spool to clean besides those under <state_dir>/spool (repeatable).")
@click.option("--lake", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The lake [default: <state_dir>/lake].")
@click.pass_context
def forget(
    ctx: click.Context,
    session_id: str | None,
    user_id: str | None,
    dry_run: bool,
    vacuum_now: bool,
    vacuum_only: bool,
    spool_dir: tuple[Path, ...],
    lake: Path | None,
) -> None:
    """Remove one session's (--session) or one user's (--user) data from the lake, the
    trainer's version folders, the processors' changelogs and the gateway spools.

    Kafka topics keep the records until their retention (docs/architecture.md, "Data
    retention and forgetting"); each run that changes something is recorded, counts only, in
    the forget_log table.
    """
    from pipeline.lake.sql import default_lake

    settings: Settings = (ctx.find_root().obj or {}).get("settings") or Settings()
    lake = lake or default_lake(ctx)
    policy = ForgetSettings()
    retention = 0 if vacuum_now else policy.vacuum_retention_hours
    if vacuum_only:
        if session_id is not None or user_id is not None or dry_run:
            raise click.UsageError("--vacuum-only takes no --session, --user or --dry-run")
        paths = [p for _, root in lakes(settings, lake) for p in session_tables(root).values()]
        n = vacuum(paths, retention)
        click.echo(f"vacuumed {len(paths)} table(s): {n} file(s) removed at least "
                   f"{retention} h ago deleted")
        return
    if (session_id is None) == (user_id is None):
        raise click.UsageError("give exactly one of --session S or --user U")
    target, value = ("session", session_id) if session_id is not None else ("user", user_id)
    assert value is not None
    if not value or len(value) > MAX_ID_CHARS or not value.isprintable():
        raise click.UsageError(
            f"--{target} must be a printable id of 1 to {MAX_ID_CHARS} characters"
        )
    spools = spool_dirs(settings, spool_dir)
    with spool_locks([] if dry_run else spools) as live:
        if dry_run:  # only probe the locks: a dry run must not delay a starting gateway
            live = {p: _held(p) for p in spools}
        s = survey(settings, lake, target, value, spools, live)
        if not s.found:
            where = "the archive, the interactions topic and the spools" if target == "user" else (
                "the lake, the trainer's versions, the changelogs, the spools and the "
                "interactions topic")
            raise click.UsageError(f"unknown {target} {value!r}: nothing of it in {where}")
        busy = [sp for sp in s.spools if sp.live and sp.pending]
        if busy and not dry_run:
            raise ForgetError(
                "; ".join(f"{sp.pending} undelivered frame(s) of these sessions wait in the "
                          f"spool {sp.path}, held by a running gateway" for sp in busy)
                + ": they are about to reach Kafka. Run forget again once the gateway has "
                "delivered them (its /metrics liverl_gateway_record_backlog is 0), or stop it."
            )
        _echo_survey(s, dry_run)
        # what only time removes: topic -> retention facts, live spool -> delivered frames
        kept: dict[str, dict[str, Any]] = {"kafka": kafka_kept(settings, s)}
        for topic, entry in kept["kafka"].items():
            click.echo(f"  kafka      {topic}: kept until retention, gone by {entry['gone_by']}")
        if dry_run:
            return
        removed: dict[str, dict[str, int]] = {"spools": {}, "changelogs": {}, "versions": {},
                                              "delta": {}}
        for sp in s.spools:
            if not sp.live and (sp.pending or sp.delivered or sp.quarantined):
                removed["spools"][str(sp.path)] = rewrite_spool(sp, s.sessions)
        kept["spools_live"] = {str(sp.path): sp.delivered for sp in s.spools
                               if sp.live and sp.delivered}
    if s.changelogs:
        tombstone(settings, s.changelogs)
        removed["changelogs"] = {c.topic: len(c.keys) for c in s.changelogs}
    for v in s.versions:
        removed["versions"][str(v.folder)] = rewrite_version(v, s.sessions)
    # The archive last: `--user` finds sessions in its interactions, so a forget interrupted
    # before it can be run again with the same arguments.
    order = sorted((d for d in s.delta if d.rows), key=lambda d: d.archive)
    for d in order:
        removed["delta"][d.label] = delete_rows(d, s.sessions)
    vacuumed = vacuum([d.path for d in s.delta], retention)
    row = {
        "forget_id": uuid.uuid4().hex,
        "ts_ms": int(time.time() * 1000),
        "operator": operator(),
        "target": target,
        "user_sha256": hashlib.sha256(value.encode()).hexdigest() if target == "user" else None,
        "sessions": s.sessions,
        "removed": orjson.dumps(removed, option=orjson.OPT_SORT_KEYS).decode(),
        "kept": orjson.dumps(kept, option=orjson.OPT_SORT_KEYS).decode(),
        "vacuum_retention_hours": retention,
        "vacuumed_files": vacuumed,
        "liverl_version": __version__,
    }
    write_log(lake, row)
    total = sum(sum(v.values()) for v in removed.values())
    click.echo(f"forgot {len(s.sessions)} session(s): {total} row(s), key(s) and frame(s) "
               f"removed; {vacuumed} file(s) vacuumed; recorded in {Path(lake) / FORGET_LOG} "
               f"as {row['forget_id']}")
    if retention:
        click.echo(f"the replaced Delta files are deleted by the first vacuum after {retention} h "
                   "(`liverl forget --vacuum-only`, or the next forget)")


def _held(spool: Path) -> bool:
    """Whether a gateway holds the spool, without keeping the lock."""
    with spool_locks([spool]) as live:
        return live[spool]
