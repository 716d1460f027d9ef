"""Delta tables read through Arrow's local filesystem (lake/reading.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pa_fs
import pytest
from deltalake import DeltaTable, write_deltalake

from pipeline.lake.reading import dataset, table_root


def _table(path: Path) -> None:
    rows = pa.table(
        {
            "session_id": ["a", "b", "c", "d"],
            "turn": [0, 1, 0, 2],
            "day": ["2026-11-30", "2026-11-30", "2026-12-01", "2026-12-01"],
        }
    )
    write_deltalake(str(path), rows, partition_by=["day"])
    write_deltalake(str(path), rows.slice(0, 1), mode="append")  # a second version


def test_reads_the_current_files_with_partition_values(tmp_path: Path) -> None:
    path = tmp_path / "a table with spaces"  # a file:// URI quotes them
    _table(path)
    ds = dataset(path)
    got = ds.to_table(filter=pc.field("day") == "2026-12-01").sort_by("session_id").to_pylist()
    assert got == [
        {"session_id": "c", "turn": 0, "day": "2026-12-01"},
        {"session_id": "d", "turn": 2, "day": "2026-12-01"},
    ]
    assert ds.count_rows() == 5
    # The same rows as deltalake's own reader, from a path or an opened (older) version.
    assert (
        ds.to_table()
        .sort_by("session_id")
        .equals(
            DeltaTable(str(path)).to_pyarrow_table().select(ds.schema.names).sort_by("session_id")
        )
    )
    assert dataset(DeltaTable(str(path), version=0)).count_rows() == 4


def test_no_python_filesystem_in_arrows_threads(tmp_path: Path) -> None:
    """deltalake's default is a PyFileSystem (Python called from Arrow's IO threads: an abort
    at interpreter exit); ours is Arrow's LocalFileSystem under the table's root."""
    _table(tmp_path / "t")
    default = DeltaTable(str(tmp_path / "t")).to_pyarrow_dataset().filesystem
    assert isinstance(default, pa_fs.PyFileSystem)  # what this module avoids
    fs = dataset(tmp_path / "t").filesystem
    assert isinstance(fs, pa_fs.SubTreeFileSystem)
    assert isinstance(fs.base_fs, pa_fs.LocalFileSystem)
    assert Path(fs.base_path) == (tmp_path / "t").resolve()


def test_only_local_tables() -> None:
    assert table_root(SimpleNamespace(table_uri="file:///srv/lake/a%20b/")) == "/srv/lake/a b/"
    assert table_root(SimpleNamespace(table_uri="/srv/lake/t")) == "/srv/lake/t"
    with pytest.raises(ValueError, match="not a local Delta table: s3://bucket/t"):
        table_root(SimpleNamespace(table_uri="s3://bucket/t"))
