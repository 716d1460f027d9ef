"""The lake's part of forget (lake/forget.py) over tables the lake's own writers wrote (the
trainer's Appender, the topic archive's commit): survey finds a session's rows (in the
archive also its undecodable records, by Kafka key), erase removes exactly those and
leaves every other session's rows and a readable table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltalake import DeltaTable

from pipeline import events
from pipeline.events import examples
from pipeline.lake import forget as lake_forget
from pipeline.lake import tables as T
from pipeline.lake.archive import TopicArchive
from pipeline.lake.writer import Appender

from .test_report import traj_row

TOPIC = "liverl.interactions.v1"


def _traj(session: str, i: int) -> dict[str, Any]:
    row = traj_row(1, 1, "trained", 0.5, 10 + i, i=i)
    row.update(event_id=f"{session}-{i}", session_id=session, response_text=f"of {session}")
    return row


def _archive(lake: Path) -> Path:
    """Interactions of a (alice) and b (bob), and an undecodable record keyed by a."""
    arch = TopicArchive(lake, TOPIC)
    records: list[tuple[bytes, bytes]] = []
    for sid, user in (("a", "alice"), ("b", "bob"), ("a", "alice")):
        ev = examples.interaction()
        ev.event_id, ev.session_id, ev.user_id = f"{sid}-{len(records)}", sid, user
        records.append((sid.encode(), events.encode(ev)))
    records.append((b"a", b"garbage of a"))
    records.append((b"b", b"garbage of b"))
    for offset, (key, value) in enumerate(records):
        buf = arch.buffer
        buf.partitions.append(0)
        buf.offsets.append(offset)
        buf.timestamps.append(1_790_000_000_000 + offset)
        buf.keys.append(key)
        buf.headers.append([])
        buf.values.append(value)
    assert arch.commit() == len(records)
    return arch.path


def _sessions(path: Path) -> list[tuple[str | None, bytes | None]]:
    t = DeltaTable(str(path)).to_pyarrow_table()
    keys = t.column("key").to_pylist() if "key" in t.column_names else [None] * t.num_rows
    return sorted(
        zip(t.column("session_id").to_pylist(), keys, strict=True),
        key=lambda r: (r[0] or "", r[1] or b""),
    )


def test_survey_finds_and_erase_removes_exactly_the_sessions_rows(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    traj = T.LakeTables(lake).uri(T.TRAJECTORIES)
    Appender(traj, T.PARTITION_BY[T.TRAJECTORIES]).append_once(
        T.to_table(T.TRAJECTORIES, [_traj(s, i) for s in ("a", "b") for i in range(2)]),
        app_id="test",
        version=1,
    )
    archive = _archive(lake)
    replay = tmp_path / "replay" / "r1" / "lake"
    Appender(T.LakeTables(replay).uri(T.TRAJECTORIES), ["day"]).append_once(
        T.to_table(T.TRAJECTORIES, [_traj("a", 0), _traj("c", 0)]), app_id="test", version=1
    )
    lakes = [("", lake), ("replay/r1/", replay)]
    assert set(lake_forget.session_tables(lake)) == {"trajectories", "events/interactions"}

    hits = {h.label: h for h in lake_forget.survey(lakes, ["a"])}
    assert {k: (h.rows, h.archive) for k, h in hits.items()} == {
        "trajectories": (2, False),
        "events/interactions": (3, True),  # two interactions and the undecodable record
        "replay/r1/trajectories": (1, False),
    }
    assert hits["events/interactions"].newest_ms == {TOPIC: 1_790_000_000_003}
    assert lake_forget.user_sessions(lakes, "alice") == {"a"}
    assert lake_forget.user_sessions(lakes, "bob") == {"b"}

    assert {k: lake_forget.erase(h, ["a"]) for k, h in hits.items()} == {
        k: h.rows for k, h in hits.items()
    }
    assert all(h.rows == 0 for h in lake_forget.survey(lakes, ["a"]))
    assert _sessions(archive) == [(None, b"b"), ("b", b"b")]  # its garbage stays too
    t = DeltaTable(str(Path(traj))).to_pyarrow_table()
    assert sorted(t.column("event_id").to_pylist()) == ["b-0", "b-1"]
    assert [s for s, _ in _sessions(replay / "trajectories")] == ["c"]
    assert lake_forget.user_sessions(lakes, "alice") == set()
    # a second erase finds nothing and commits nothing
    version = DeltaTable(str(archive)).version()
    assert lake_forget.erase(hits["events/interactions"], ["a"]) == 0
    assert DeltaTable(str(archive)).version() == version
