"""``liverl tap TOPIC``: print a topic's decoded events (the reading is ``kafka/tap.py``)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from pipeline.kafka.errors import TapError, TopicMissing
from pipeline.kafka.tap import (
    TapRow,
    expected_type,
    fmt_ts,
    known_list,
    parse_since,
    resolve_topic,
    spec_types,
    summary,
    tap_records,
)
from pipeline.settings import Settings

if TYPE_CHECKING:
    from rich.table import Table


# ---- output --------------------------------------------------------------------------------


def _table(title: str | None, show_header: bool) -> Table:
    from rich.table import Table

    table = Table(title=title, show_header=show_header, box=None, pad_edge=False)
    table.add_column("ts (UTC)", no_wrap=True, width=23)
    table.add_column("p@offset", no_wrap=True, justify="right", width=10)
    table.add_column("key", no_wrap=True, max_width=24, overflow="ellipsis")
    table.add_column("type", no_wrap=True, width=14)
    table.add_column("summary", overflow="fold")
    return table


def _add(table: Table, row: TapRow) -> None:
    key = "-" if row.key is None else row.key.decode("utf-8", "replace")
    kind = row.type if row.event is not None else f"[red]{row.type}[/]"
    table.add_row(
        fmt_ts(row.timestamp_ms), f"{row.partition}@{row.offset}", key, kind, summary(row)
    )


@click.command("tap")
@click.argument("topic")
@click.option("--since", default=None, help="Start at records from 10m/2h/1d ago or an ISO time.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new records until Ctrl-C.")
@click.option("--session", default=None, help="Only records with this key (session id).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Stop after N records.")
@click.option("--namespace", default=None, help="Read replay namespace NAME's copy of the topic.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="table for people; json: one decoded envelope per line (Kafka coordinates in _kafka).",
)
@click.pass_context
def tap(
    ctx: click.Context,
    topic: str,
    since: str | None,
    follow: bool,
    session: str | None,
    limit: int | None,
    namespace: str | None,
    fmt: str,
) -> None:
    """Print a topic's decoded events (full name or short: interactions, rewards, …).

    Reads from the beginning, or from --since; stops at the end offsets seen at start
    unless --follow. Never commits offsets for any consumer group.
    """
    from rich.console import Console

    obj: dict[str, Any] = ctx.find_root().obj or {}
    settings: Settings = obj.get("settings") or Settings()
    since_ms = parse_since(since) if since is not None else None
    types = spec_types(settings)
    name = resolve_topic(topic, sorted(types))
    if namespace or settings.kafka.namespace:
        from pipeline.kafka import names
        from pipeline.replay.namespace import enter_checked

        settings = enter_checked(settings, namespace)
        name = names.resolve(name, settings.kafka.namespace)
    expected = expected_type(name, types)
    console = Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)
    rows = tap_records(
        settings,
        name,
        since_ms=since_ms,
        follow=follow,
        session=session,
        limit=limit,
        expected=expected,
    )
    try:
        if fmt == "json":
            out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
            for row in rows:
                line = row.to_json() + b"\n"
                if out is not None:
                    out.write(line)
                    out.flush()
                else:  # pragma: no cover - text-only streams
                    click.echo(line.decode(), nl=False)
            return
        if not follow:
            table = _table(f"{name}", True)
            count = 0
            for row in rows:
                _add(table, row)
                count += 1
            if count:
                console.print(table)
            click.echo(f"{count} record(s) from {name}", err=True)
            return
        first = True
        for row in rows:  # streaming: one row per table, header once
            table = _table(None, first)
            _add(table, row)
            console.print(table)
            first = False
    except TopicMissing as exc:
        known = known_list(list(types))
        raise TapError(f"unknown topic {topic!r}: {exc.message}; known: {known}") from None
    except KeyboardInterrupt:
        pass
