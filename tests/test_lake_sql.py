"""``liverl sql``: DuckDB over the lake's Delta tables, each a view named by its path."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import orjson
import pyarrow as pa
import pytest
from click.testing import CliRunner
from deltalake import write_deltalake

from pipeline.cli import cli
from pipeline.lake.sql import find_tables


def _lake(tmp_path: Path) -> Path:
    lake = tmp_path / "lake"
    traj = pa.table(
        {
            "session_id": ["s1", "s1", "s2", "s3", "s3", "s3"],
            "status": ["trained", "masked", "trained", "trained", "trained", "no_hint"],
            "reward": [1.0, 0.0, -1.0, 0.5, 0.25, 2.0],
        }
    )
    write_deltalake(str(lake / "trajectories"), traj)
    write_deltalake(str(lake / "trajectories"), traj.slice(0, 1), mode="append")
    write_deltalake(str(lake / "events" / "interactions"), pa.table({"turn": [1, 2, 3]}))
    (lake / "not_a_table").mkdir()
    return lake


def test_find_tables_names_nested_by_path(tmp_path: Path) -> None:
    lake = _lake(tmp_path)
    assert sorted(find_tables(lake)) == ["events_interactions", "trajectories"]


def test_select_where_group_by(tmp_path: Path) -> None:
    lake = _lake(tmp_path)
    query = (
        "SELECT status, count(*) AS n, sum(reward) AS total FROM trajectories "
        "WHERE session_id <> 's2' GROUP BY status ORDER BY status"
    )
    res = CliRunner().invoke(cli, ["sql", query, "--lake", str(lake), "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = [orjson.loads(line) for line in res.stdout.splitlines()]
    # s1 trained twice (the appended copy), s3 trained 0.5 + 0.25; s2 excluded.
    assert rows == [
        {"status": "masked", "n": 1, "total": 0.0},
        {"status": "no_hint", "n": 1, "total": 2.0},
        {"status": "trained", "n": 4, "total": 2.75},
    ]

    res = CliRunner().invoke(
        cli,
        ["sql", "SELECT sum(turn) AS s FROM events_interactions", "--lake", str(lake),
         "--format", "csv"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert list(csv.reader(io.StringIO(res.stdout))) == [["s"], ["6"]]

    res = CliRunner().invoke(
        cli, ["sql", "SELECT count(*) AS n FROM trajectories", "--lake", str(lake)],
        terminal_width=200,
    )  # fmt: skip
    assert res.exit_code == 0 and "7" in res.stdout


def test_tables_lists_names_and_counts(tmp_path: Path) -> None:
    lake = _lake(tmp_path)
    res = CliRunner().invoke(cli, ["sql", "--tables", "--lake", str(lake), "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = [orjson.loads(line) for line in res.stdout.splitlines()]
    assert {r["table"]: r["rows"] for r in rows} == {"events_interactions": 3, "trajectories": 7}


def test_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    lake = _lake(tmp_path)
    for args in (
        ["sql", "SELEC nonsense", "--lake", str(lake)],
        ["sql", "SELECT * FROM nosuch", "--lake", str(lake)],
        ["sql", "SELECT 1", "--lake", str(tmp_path / "empty")],
        ["sql", "--lake", str(lake)],
    ):
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2, (args, res.output)
        assert res.exception is None or isinstance(res.exception, SystemExit)
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), res.output
        assert "Traceback" not in res.output


def test_judge_consistency_view_types_the_archived_matches(tmp_path: Path) -> None:
    """Archived byte-exact like the topic (a match sent twice, a dead letter): one row per
    judge and version, the tally of its newest match, its matches counted once."""
    from deltalake import write_deltalake

    from pipeline.lake.sql import run_query

    def match(eid: str, judge: str, agree: int, disagree: int, flagged: bool = False) -> bytes:
        return orjson.dumps(
            {
                "type": "judge_consistency",
                "event_id": eid,
                "judge_id": judge,
                "judge_version": "v1",
                "agree": agree,
                "disagree": disagree,
                "abstain": 0,
                "consistency": (agree + 1) / (agree + disagree + 2),
                "flagged": flagged,
                "ts_ms": 1000 + agree + disagree,
            }
        )

    rows = [
        ("m1", match("m1", "replies", 1, 0)),
        ("m2", match("m2", "replies", 1, 1)),
        ("m2", match("m2", "replies", 1, 1)),
        ("m3", match("m3", "replies", 1, 2, True)),
        ("r1", match("r1", "rules", 0, 1)),
        (None, b"\xff not json"),
    ]
    write_deltalake(str(tmp_path / "events" / "judge_consistency"), pa.table({
        "payload": pa.array([p for _, p in rows], pa.binary()),
        "event_id": pa.array([e for e, _ in rows], pa.string()),
        "event_type": pa.array(["judge_consistency" if e else None for e, _ in rows],
                               pa.string()),
    }))  # fmt: skip
    cols, got = run_query(tmp_path, "SELECT judge_id, agree, disagree, consistency, matches, "
                          "flags FROM judge_consistency ORDER BY judge_id")  # fmt: skip
    assert cols[0] == "judge_id"
    assert got == [("replies", 1, 2, pytest.approx(2 / 5), 3, 1),
                   ("rules", 0, 1, pytest.approx(1 / 3), 1, 0)]  # fmt: skip


def test_judge_consistency_view_takes_a_contradiction_as_newer_than_the_match_it_takes_back(
    tmp_path: Path,
) -> None:
    """A verdict's match taken back (its turn's outcomes contradicted each other) lowers
    agree + disagree + abstain by one: that sum used to make the match it took back the
    newest. Matched verdicts, contradicted included, then contradicted, order them."""
    from pipeline.lake.sql import run_query

    def match(eid: str, agree: int, contradictions: int = 0) -> dict[str, object]:
        return {
            "type": "judge_consistency",
            "event_id": eid,
            "judge_id": "replies",
            "judge_version": "v1",
            "agree": agree,
            "disagree": 0,
            "abstain": 0,
            "consistency": (agree + 1) / (agree + 2),
            "contradictions": contradictions,
            "contradicted": contradictions > 0,
            "ts_ms": 1000,
        }

    # two agreements, the second taken back, then a verdict contradicted at once
    rows = [match("m1", 1), match("m2", 2), match("back", 1, 1), match("once", 1, 2)]
    for n in (3, 4):
        write_deltalake(str(tmp_path / "events" / "judge_consistency"), pa.table({
            "payload": pa.array([orjson.dumps(r) for r in rows[:n]], pa.binary()),
            "event_id": pa.array([r["event_id"] for r in rows[:n]], pa.string()),
            "event_type": pa.array(["judge_consistency"] * n, pa.string()),
        }), mode="overwrite")  # fmt: skip
        _, got = run_query(tmp_path, "SELECT agree, contradicted, consistency, matches "
                           "FROM judge_consistency")  # fmt: skip
        assert got == [(1, n - 2, pytest.approx(2 / 3), n)]
