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
