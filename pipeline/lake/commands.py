"""``liverl archive``: copy topics into the lake's ``events/<topic>`` Delta tables."""

from __future__ import annotations

import contextlib
import csv
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import click
import orjson

from pipeline.kafka import names
from pipeline.lake.archive import (
    Archiver,
    CommitReport,
    MissingTopics,
    Span,
    archive_path,
    table_name,
)
from pipeline.lake.errors import ArchiveStopped, SqlError
from pipeline.lake.sql import run_query, table_counts
from pipeline.settings import Settings
from pipeline.trainer.config import TrainerSettings


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[list[int]]:
    """SIGTERM/SIGINT end the run after committing what was read (``liverl up`` stops its
    children with SIGTERM). Whatever a Kafka call with the broker gone holds the main thread
    for, the process exits :data:`pipeline.stopping.STOP_S` after the first signal, or at once
    on a second one: what was read and not committed is archived at the next start."""
    from pipeline import stopping

    got: list[int] = []

    def handler(sig: int, _frame: object) -> None:
        got.append(sig)

    if threading.current_thread() is not threading.main_thread():
        yield got  # signals reach the main thread only
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    disarm = stopping.arm(
        stopping.STOP_S,
        "liverl archive: not stopped after {why}, Kafka unreachable? Exiting now; records "
        "not committed yet are archived at the next start",
    )
    try:
        yield got
    finally:
        disarm()
        for s, h in previous.items():
            signal.signal(s, h)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _todo(spans: dict[tuple[str, int], Span]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (topic, _p), span in spans.items():
        if span.end is not None:
            out[topic] = out.get(topic, 0) + max(0, span.end - span.start)
    return out


def _warn_expired(spans: dict[tuple[str, int], Span]) -> None:
    for (topic, p), span in sorted(spans.items()):
        if span.expired:
            click.echo(
                f"warning: {topic}[{p}]: {span.expired} record(s) before offset {span.start} "
                "were deleted by retention before they were archived",
                err=True,
            )


@click.command("archive")
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Keep archiving new records until SIGTERM/Ctrl-C (what `liverl up` runs).",
)
@click.option(
    "--topics",
    "topic_args",
    multiple=True,
    metavar="T[,T...]",
    help="Topics to archive, full or short names (interactions, liverl.rewards.v1), "
    "comma-separated or repeated. Default: every liverl topic.",
)
@click.option(
    "--lake",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Lake folder; tables go to <lake>/events/<topic>. Default: <state_dir>/lake.",
)
@click.option(
    "--batch-records",
    type=click.IntRange(min=1),
    default=100_000,
    show_default=True,
    help="Commit after this many records.",
)
@click.option(
    "--batch-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=128.0,
    show_default=True,
    help="...or this many MB of keys and values.",
)
@click.option(
    "--batch-seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="...or this long after the batch's first record.",
)
@click.pass_context
def archive(
    ctx: click.Context,
    follow: bool,
    topic_args: tuple[str, ...],
    lake: Path | None,
    batch_records: int,
    batch_mb: float,
    batch_seconds: float,
) -> None:
    """Copy topics byte-exact into Delta tables <lake>/events/<topic>, partitioned by day.

    Each commit records, per partition, the last offset it holds (Delta application
    transaction archive:<topic>:<partition>); a run starts after those offsets, so
    running again, or after a crash, adds nothing twice and skips nothing. Without
    --follow it stops at the end offsets seen at start. No consumer group is used.

    \b
    liverl archive                          # everything new, with progress
    liverl archive --topics interactions,rewards
    liverl archive --follow                 # tail (started by `liverl up`)
    liverl sql "SELECT event_type, count(*) FROM events_interactions GROUP BY 1"
    """
    with _stop_on_signals() as stopped:
        _archive(ctx, stopped, follow, topic_args, lake, batch_records, batch_mb, batch_seconds)


def _archive(
    ctx: click.Context,
    stopped: list[int],
    follow: bool,
    topic_args: tuple[str, ...],
    lake: Path | None,
    batch_records: int,
    batch_mb: float,
    batch_seconds: float,
) -> None:
    obj: dict[str, Any] = ctx.find_root().obj or {}
    settings: Settings = obj.get("settings") or Settings()
    # In a replay namespace (LIVERL_KAFKA_NAMESPACE) the topics are the namespace's copies;
    # their tables keep the full name (events/replay.NAME.liverl.…), apart from the live ones.
    topics = [
        names.resolve(t, settings.kafka.namespace)
        for t in names.resolve_topics(topic_args, others=True)
    ]
    lake = lake if lake is not None else default_lake(ctx)
    archiver = Archiver(
        settings,
        topics,
        lake,
        follow=follow,
        batch_records=batch_records,
        batch_bytes=int(batch_mb * 1024 * 1024),
        batch_seconds=batch_seconds,
        stopping=lambda: bool(stopped),
    )
    try:
        spans = archiver.open()
    except MissingTopics as exc:
        raise click.UsageError(exc.message) from None
    except ArchiveStopped:
        _log("stopped before the broker answered; nothing was read")
        return
    from pipeline.durable import writable_problem

    if (problem := writable_problem(Path(lake) / "events")) is not None:
        archiver.close()
        raise click.ClickException(f"{problem}; choose another --lake")
    _warn_expired(spans)
    if follow:
        _follow(archiver, lake, stopped)
    else:
        _once(archiver, spans, stopped)


def _log(line: str) -> None:
    """One line to stdout, flushed: under ``liverl up`` stdout is a log file."""
    click.echo(f"{_now()} {line}")
    sys.stdout.flush()


def _follow(archiver: Archiver, lake: Path, stopped: list[int]) -> None:
    _log(
        f"archiving {len(archiver.topics)} topic(s) into {Path(lake) / 'events'}, "
        f"committing every {archiver.batch_seconds:g} s, {archiver.batch_records} records "
        f"or {archiver.batch_bytes / 2**20:g} MB",
    )

    def logged(report: CommitReport) -> None:
        parts = ", ".join(f"{table_name(t)} {n}" for t, n in sorted(report.rows.items()))
        _log(f"archived {report.total} record(s) in {report.seconds:.2f} s: {parts}")

    archiver.run(lambda: bool(stopped), on_commit=logged)
    _log("stopped; everything read was committed")


def _once(archiver: Archiver, spans: dict[tuple[str, int], Span], stopped: list[int]) -> None:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Table
    from rich.text import Text

    todo = {t: n for t, n in _todo(spans).items() if n}
    if not todo:
        archiver.close()
        click.echo(f"nothing new to archive: {len(archiver.topics)} topic(s) up to date")
        return

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.0f} rec/s" if speed else "", style="progress.data.speed")

    err = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        Rate(),
        TimeElapsedColumn(),
        console=err,
        disable=not err.is_terminal,
    )
    tasks = {t: progress.add_task(table_name(t), total=n) for t, n in sorted(todo.items())}
    started = time.monotonic()

    def advance(read: dict[str, int]) -> None:
        for t, n in read.items():
            progress.advance(tasks[t], n)

    with progress:
        archiver.run(lambda: bool(stopped), on_read=advance)
        for task in tasks.values():  # control records and aborted transactions end it early
            progress.update(task, completed=progress.tasks[task].total)
    elapsed = max(time.monotonic() - started, 1e-9)
    out = Console(width=None if sys.stdout.isatty() else 200)
    table = Table("topic", "table", "records", "MB", "commits")
    records = nbytes = 0
    for topic, sink in archiver.tables.items():
        if sink.records or topic in todo:
            table.add_row(
                topic,
                str(archive_path(archiver.lake_root, topic)),
                f"{sink.records:,}",
                f"{sink.bytes / 1e6:.1f}",
                str(sink.commits),
            )
        records += sink.records
        nbytes += sink.bytes
    out.print(table)
    how = "interrupted; " if stopped else ""
    out.print(
        f"{how}archived {records:,} record(s), {nbytes / 1e6:.1f} MB in {elapsed:.1f} s: "
        f"{records / elapsed:,.0f} records/s, {nbytes / 1e6 / elapsed:.1f} MB/s",
        highlight=False,
    )


# ---- liverl sql ----------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return orjson.dumps(value, default=_json_default).decode()
    return str(value)


def trainer_paths(ctx: click.Context) -> TrainerSettings:
    """``[trainer]`` with its paths under the state dir, as ``liverl train`` resolves them:
    train, report, sql and archive find the same lake."""
    obj: dict[str, Any] = ctx.find_root().obj or {}
    settings: Settings = obj.get("settings") or Settings()
    return settings.trainer.under_state_dir(settings.state_dir)


def default_lake(ctx: click.Context) -> Path:
    """``[trainer] lake_root`` if set, else ``<state_dir>/lake``."""
    return Path(trainer_paths(ctx).lake_root)


@click.command("sql")
@click.argument("query", required=False)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "csv", "json"]),
    default="table",
    show_default=True,
    help="json: one object per row.",
)
@click.option("--tables", "list_tables", is_flag=True, help="List the views and row counts.")
@click.option(
    "--lake",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Lake folder (default: <state_dir>/lake).",
)
@click.pass_context
def sql(
    ctx: click.Context, query: str | None, fmt: str, list_tables: bool, lake: Path | None
) -> None:
    """Run DuckDB SQL over the lake's Delta tables, each a view named by its path.

    \b
    liverl sql --tables
    liverl sql "SELECT status, count(*) FROM trajectories GROUP BY status"
    liverl sql "SELECT * FROM weights ORDER BY version" --format csv
    """
    lake = lake if lake is not None else default_lake(ctx)
    if list_tables:
        columns = ["table", "rows", "path"]
        rows: list[tuple[Any, ...]] = list(table_counts(lake))
    elif not query or not query.strip():
        raise SqlError('give a query, e.g. liverl sql "SELECT * FROM weights", or --tables')
    else:
        columns, rows = run_query(lake, query)
    if fmt == "json":
        for row in rows:
            line = orjson.dumps(dict(zip(columns, row, strict=True)), default=_json_default)
            click.echo(line.decode())
    elif fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell(v) for v in row])
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(*columns, show_lines=False)
        for row in rows:
            table.add_row(*[_cell(v) for v in row])
        console = Console(width=None if sys.stdout.isatty() else 200)
        console.print(table)
        click.echo(f"{len(rows)} row(s)", err=True)
