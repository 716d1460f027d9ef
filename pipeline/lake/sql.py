"""DuckDB over every Delta table of the lake (``liverl sql``'s engine; the command is in
``lake/commands.py``).

Every folder under the lake holding a ``_delta_log`` is a table (``trajectories``,
``gradient_steps``, ``weights``, nested ones such as ``events/interactions``), registered
as a view named by its path with slashes (and other non-identifier characters) as
underscores: ``events_interactions``. Tables are read with ``deltalake`` as pyarrow
datasets, so DuckDB pushes filters and projections into the Parquet scan. With the
``judge_consistency`` topic archived, the view ``judge_consistency`` types it: one row per
judge and version with its current tally.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from pipeline.lake.errors import SqlError

log = logging.getLogger(__name__)


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


# Typed per judge and version from the archived judge_consistency topic (byte-exact JSON):
# the tally of its newest match, and how many matches flagged it. Newest: the most verdicts
# matched, contradicted ones included; a contradiction taking a match back leaves that number
# as it was, and comes later by its higher count of contradicted verdicts. A match archived
# twice (a re-sent event) counts once.
JUDGE_CONSISTENCY_VIEW = """
CREATE VIEW judge_consistency AS
WITH raw AS (
    SELECT DISTINCT ON (event_id) decode(payload) AS j
    FROM events_judge_consistency
    WHERE event_type = 'judge_consistency' AND payload IS NOT NULL
), t AS (
    SELECT json_extract_string(j, '$.judge_id') AS judge_id,
           json_extract_string(j, '$.judge_version') AS judge_version,
           CAST(json_extract(j, '$.agree') AS BIGINT) AS agree,
           CAST(json_extract(j, '$.disagree') AS BIGINT) AS disagree,
           CAST(json_extract(j, '$.abstain') AS BIGINT) AS abstain,
           coalesce(CAST(json_extract(j, '$.contradictions') AS BIGINT), 0) AS contradicted,
           CAST(json_extract(j, '$.consistency') AS DOUBLE) AS consistency,
           coalesce(CAST(json_extract(j, '$.flagged') AS BOOLEAN), false) AS flagged,
           CAST(json_extract(j, '$.ts_ms') AS BIGINT) AS ts_ms
    FROM raw
), m AS (
    SELECT *, [agree + disagree + abstain + contradicted, contradicted] AS newest FROM t
)
SELECT judge_id, judge_version,
       arg_max(agree, newest) AS agree,
       arg_max(disagree, newest) AS disagree,
       arg_max(abstain, newest) AS abstain,
       arg_max(contradicted, newest) AS contradicted,
       arg_max(consistency, newest) AS consistency,
       count(*) AS matches,
       count(*) FILTER (WHERE flagged) AS flags,
       max(ts_ms) AS last_ts_ms
FROM m GROUP BY judge_id, judge_version
"""


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
            log.warning("skipping %s: %s: %s", path, type(exc).__name__, exc)
            continue
        con.register(name, dataset)
    if "events_judge_consistency" in tables:
        con.execute(JUDGE_CONSISTENCY_VIEW)
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
