"""``liverl sql "SELECT …"``: DuckDB over every Delta table of the lake.

Every folder under the lake holding a ``_delta_log`` is a table (``trajectories``,
``gradient_steps``, ``weights``, nested ones such as ``events/interactions``), registered
as a view named by its path with slashes (and other non-identifier characters) as
underscores: ``events_interactions``. Tables are read with ``deltalake`` as pyarrow
datasets, so DuckDB pushes filters and projections into the Parquet scan.
"""

from __future__ import annotations

import csv
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import click
import orjson

from pipeline.lake.errors import SqlError


def view_name(rel: Path) -> str:
    """``events/liverl.interactions.v1`` -> ``events_liverl_interactions_v1``."""
    name = re.sub(r"[^0-9A-Za-z_]", "_", "/".join(rel.parts).replace("/", "_"))
    return f"t_{name}" if name[:1].isdigit() else name


def find_tables(lake: Path) -> dict[str, Path]:
    """view name -> table folder, for every Delta table under ``lake`` (not inside a table)."""
    found: dict[str, Path] = {}
    if not lake.is_dir():
        return found

    def walk(folder: Path) -> None:
        for child in sorted(folder.iterdir()):
            if not child.is_dir() or child.name.startswith((".", "_")):
                continue
            if (child / "_delta_log").is_dir():
                found.setdefault(view_name(child.relative_to(lake)), child)
            else:
                walk(child)

    walk(lake)
    return found


def connect(lake: Path) -> tuple[Any, dict[str, Path]]:
    """A DuckDB connection with every table of the lake registered as a view."""
    import duckdb

    from .reading import dataset as delta_dataset

    tables = find_tables(lake)
    if not tables:
        raise SqlError(
            f"no Delta tables under {lake}; run `liverl up` or `liverl train` first "
            "(or point --lake at <state_dir>/lake)"
        )
    con = duckdb.connect(":memory:")
    for name, path in tables.items():
        try:
            dataset = delta_dataset(path)
        except Exception as exc:  # noqa: BLE001 - one unreadable table must not hide the rest
            click.echo(f"warning: skipping {path}: {type(exc).__name__}: {exc}", err=True)
            continue
        con.register(name, dataset)
    return con, tables


def run_query(lake: Path, query: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    import duckdb

    con, _ = connect(lake)
    try:
        cur = con.execute(query)
        columns = [d[0] for d in cur.description or []]
        rows = cur.fetchall() if cur.description else []
    except duckdb.Error as exc:
        raise SqlError(f"SQL: {exc}") from None
    finally:
        con.close()
    return columns, rows


def table_counts(lake: Path) -> list[tuple[str, int, str]]:
    con, tables = connect(lake)
    try:
        out = []
        for name, path in tables.items():
            try:
                (n,) = con.execute(f'SELECT count(*) FROM "{name}"').fetchone()
            except Exception:  # noqa: BLE001 - skipped at registration
                continue
            out.append((name, int(n), str(path)))
        return out
    finally:
        con.close()


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


def default_lake(ctx: click.Context) -> Path:
    """``<state_dir>/lake`` as the trainer resolves it: train, report, sql and archive agree."""
    from pipeline.settings import Settings

    obj: dict[str, Any] = ctx.find_root().obj or {}
    settings: Settings = obj.get("settings") or Settings()
    return Path(settings.trainer.under_state_dir(settings.state_dir).lake_root)


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
