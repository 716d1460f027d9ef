"""Idempotent Delta appends: a retried commit with the same application transaction is skipped."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from pipeline.lake import Appender
from pipeline.lake.tables import TRAJECTORIES, to_table


def test_retried_commit_is_skipped(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    data = pa.table({"x": [1, 2]})
    kept = Appender(uri)
    assert kept.committed_version("app") is None

    def append(app: str, version: int) -> bool:  # a fresh handle: a retry after a restart
        return Appender(uri).append_once(data, app_id=app, version=version)

    assert append("app", 1)
    assert not append("app", 1)  # retry: skipped
    assert not kept.append_once(data, app_id="app", version=1)  # by a handle opened earlier too
    assert append("other", 1)  # apps are independent
    assert kept.append_once(data, app_id="app", version=2)
    assert not append("app", 1)  # older: skipped too
    assert Appender(uri).committed_version("app") == 2
    assert Appender(uri).committed_version("other") == 1
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 6


def test_rows_must_match_the_declared_schema() -> None:
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError)):
        to_table(TRAJECTORIES, [{"event_id": "a", "turn": "not-a-number"}])


def test_a_lake_written_before_a_new_column_accepts_rows_with_it(tmp_path: Path) -> None:
    """Releases add columns (opd_mask, drift); an existing lake must keep accepting appends."""
    uri = str(tmp_path / "t")
    assert Appender(uri).append_once(pa.table({"a": [1]}), app_id="app", version=1)
    assert Appender(uri).append_once(pa.table({"a": [2], "b": [[1.0]]}), app_id="app", version=2)
    rows = sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: r["a"])
    assert rows == [{"a": 1, "b": None}, {"a": 2, "b": [1.0]}]


def test_gate_vote_rows_round_trip_through_a_partitioned_table(tmp_path: Path) -> None:
    from pipeline.events import GateVote
    from pipeline.events.examples import examples
    from pipeline.lake import tables as T

    vote = examples()["gate_vote"]
    assert isinstance(vote, GateVote)
    tie = GateVote(
        event_id="e2",
        ts_ms=vote.ts_ms,
        producer=vote.producer,
        policy_id=vote.policy_id,
        version=13,
        live_version=0,
        prompt_id="ab",
        source="probe",
        judge="capability",
        vote=0,
    )
    rows = [T.gate_vote_row(vote, "cand answer", "live answer"), T.gate_vote_row(tie, "", "")]
    assert set(rows[0]) == set(T.GATE_VOTES_SCHEMA.names)
    uri = str(tmp_path / T.GATE_VOTES)
    Appender(uri, T.PARTITION_BY[T.GATE_VOTES]).append_once(
        T.to_table(T.GATE_VOTES, rows), app_id="gate", version=1
    )
    dt = DeltaTable(uri)
    assert dt.metadata().partition_columns == ["day"]
    got = {r["event_id"]: r for r in dt.to_pyarrow_table().to_pylist()}
    assert got["e2"]["vote"] == 0 and got["e2"]["live_score"] is None
    first = got[vote.event_id]
    assert first["vote"] == 1 and first["candidate_answer"] == "cand answer"
    assert first["detail"] == '{"metric":"mean_nll","tokens":187}'
    assert first["day"] == "2026-09-21"
