"""Idempotent Delta appends: a retried commit with the same application transaction is skipped."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from pipeline.lake import append_once, committed_version
from pipeline.lake.tables import TRAJECTORIES, to_table


def test_retried_commit_is_skipped(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    data = pa.table({"x": [1, 2]})
    assert committed_version(uri, "app") is None
    assert append_once(uri, data, app_id="app", version=1)
    assert not append_once(uri, data, app_id="app", version=1)  # retry: skipped
    assert append_once(uri, data, app_id="other", version=1)  # apps are independent
    assert append_once(uri, data, app_id="app", version=2)
    assert not append_once(uri, data, app_id="app", version=1)  # older: skipped too
    assert committed_version(uri, "app") == 2
    assert committed_version(uri, "other") == 1
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 6


def test_rows_must_match_the_declared_schema() -> None:
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError)):
        to_table(TRAJECTORIES, [{"event_id": "a", "turn": "not-a-number"}])


def test_a_lake_written_before_a_new_column_accepts_rows_with_it(tmp_path: Path) -> None:
    """Releases add columns (opd_mask, drift); an existing lake must keep accepting appends."""
    from pipeline.lake.writer import Appender

    uri = str(tmp_path / "t")
    assert append_once(uri, pa.table({"a": [1]}), app_id="app", version=1)
    assert Appender(uri).append_once(
        pa.table({"a": [2], "b": [[1.0]]}), app_id="app", version=2
    )
    rows = sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: r["a"])
    assert rows == [{"a": 1, "b": None}, {"a": 2, "b": [1.0]}]
