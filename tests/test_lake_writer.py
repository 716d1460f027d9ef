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
    assert Appender(uri).append_once(
        pa.table({"a": [2], "b": [[1.0]]}), app_id="app", version=2
    )
    rows = sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: r["a"])
    assert rows == [{"a": 1, "b": None}, {"a": 2, "b": [1.0]}]
