"""The lake's part of ``liverl forget``: find and remove sessions' rows in every Delta table
with a ``session_id`` column (docs/architecture.md#data-retention-and-forgetting).

Here, beside the tables' writers, because how a row names its session is the lake's format:
``session_id``, and in the topic archive (``events/``) also the Kafka ``key`` of a record with
no decodable envelope (dead letters, tombstones). Rows are removed by rewriting the partitions
that hold them (:func:`erase`), then a lite :func:`vacuum` deletes the replaced files once no
reader of an older table version may still need them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from pipeline.errors import ForgetError

_COMMIT_ATTEMPTS = 8


@dataclass
class DeltaHit:
    label: str  # table path under its lake (replay lakes: replay/NAME/<table>)
    path: Path
    rows: int
    archive: bool  # an archive table: dead letters and tombstones match by Kafka key
    newest_ms: dict[str, int] = field(default_factory=dict)  # archive: topic -> newest record


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
    on a string column fails on files delta-rs wrote with view types (see erase)."""
    import pyarrow.compute as pc

    sid = batch.column("session_id")
    mask = pc.fill_null(pc.is_in(sid, value_set=pa.array(sessions, pa.string())), False)
    if archive:
        keys = pa.array([s.encode() for s in sessions], pa.binary())
        in_keys = pc.fill_null(pc.is_in(batch.column("key"), value_set=keys), False)
        mask = pc.or_(mask, pc.and_(pc.is_null(sid), in_keys))
    return mask


def session_tables(root: Path) -> dict[str, Path]:
    """Tables under ``root`` with a ``session_id`` column, by label (forget's own log names
    its sessions in a ``sessions`` column, so it is never one of them)."""
    from pipeline.lake.reading import dataset as delta_dataset
    from pipeline.lake.sql import find_tables

    out: dict[str, Path] = {}
    for path in find_tables(root).values():
        if "session_id" in delta_dataset(path).schema.names:
            out[path.relative_to(root).as_posix()] = path
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


def survey(lakes: Iterable[tuple[str, Path]], sessions: list[str]) -> list[DeltaHit]:
    """Per session-bearing table of each lake ``(label prefix, root)``: the sessions' rows,
    and for archive tables the newest record per topic (when Kafka's retention drops them)."""
    hits = []
    for prefix, root in lakes:
        for label, path in session_tables(root).items():
            rows, archive = _matches(path, sessions, ["topic", "timestamp_ms"])
            hit = DeltaHit(prefix + label, path, rows.num_rows, archive)
            if {"topic", "timestamp_ms"} <= set(rows.column_names) and rows.num_rows:
                newest = rows.group_by("topic").aggregate([("timestamp_ms", "max")])
                hit.newest_ms = dict(
                    zip(
                        newest["topic"].to_pylist(),
                        newest["timestamp_ms_max"].to_pylist(),
                        strict=True,
                    )
                )
            hits.append(hit)
    return hits


def user_sessions(lakes: Iterable[tuple[str, Path]], user: str) -> set[str]:
    """Sessions whose archived interactions carry ``user_id == user`` (every archive table of
    every lake holding ``interaction`` events; the payload is read, since the archive keeps
    no user column)."""
    from pipeline.lake.reading import dataset as delta_dataset

    needle = orjson.dumps(user)
    found: set[str] = set()
    for _prefix, root in lakes:
        for path in session_tables(root).values():
            dataset = delta_dataset(path)
            if not {"event_type", "payload"} <= set(dataset.schema.names):
                continue
            scanner = dataset.scanner(columns=["event_type", "session_id", "payload"])
            for batch in scanner.to_batches():
                rows = zip(
                    batch.column("event_type").to_pylist(),
                    batch.column("session_id").to_pylist(),
                    batch.column("payload").to_pylist(),
                    strict=True,
                )
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


def erase(hit: DeltaHit, sessions: list[str]) -> int:
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
                str(hit.path),
                reader,
                mode="overwrite",
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
