"""Reading the lake's Delta tables as pyarrow datasets, through Arrow's own local filesystem.

``DeltaTable.to_pyarrow_dataset()`` by default opens files through a filesystem written in
Python (deltalake's ``DeltaStorageHandler`` in a ``PyFileSystem``), which Arrow's IO threads
call back into. When the interpreter exits with those threads still around, the process
aborts after its work is done: "terminate called without an active exception", exit 134
(delta-rs #2184; seen here at the end of ``bench/freshness.py``, and in 2 of 71 runs of a small
filtered scan). The lake is always a local folder (``trainer.lake_root``), so Arrow's
``LocalFileSystem`` under the table's root reads the same files with no Python in its
threads. Partition values still come from the Delta log, as before.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow.dataset as pa_ds
import pyarrow.fs as pa_fs
from deltalake import DeltaTable


def table_root(table: DeltaTable) -> str:
    """The local folder of a table opened from a path (``file://`` URI or plain path)."""
    uri = table.table_uri
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    if parsed.scheme and len(parsed.scheme) > 1:  # s3://, az://...: not a lake of ours
        raise ValueError(f"not a local Delta table: {uri}")
    return uri


def dataset(table: DeltaTable | str | Path) -> pa_ds.Dataset:
    """The table's current files (``table``: a DeltaTable or its folder) as a dataset read
    with Arrow's local filesystem (see the module docstring)."""
    dt = table if isinstance(table, DeltaTable) else DeltaTable(str(table))
    fs = pa_fs.SubTreeFileSystem(table_root(dt), pa_fs.LocalFileSystem())
    return dt.to_pyarrow_dataset(filesystem=fs)
