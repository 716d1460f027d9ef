"""Idempotent Delta appends keyed by an application transaction.

Step 2 of the publish protocol (docs/architecture.md#exactly-once-publishing).

Each append carries ``Transaction(app_id, version)`` in the same commit as the data, so
"was this batch written?" is answered atomically by the table itself: a retry after a crash
reads ``transaction_version(app_id)`` and skips what is already there.
"""

from __future__ import annotations

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake


def committed_version(table_uri: str, app_id: str) -> int | None:
    """Highest transaction version committed by ``app_id`` (None: table or app unseen)."""
    if not DeltaTable.is_deltatable(table_uri):
        return None
    return DeltaTable(table_uri).transaction_version(app_id)


def append_once(
    table_uri: str,
    data: pa.Table,
    *,
    app_id: str,
    version: int,
    partition_by: list[str] | None = None,
) -> bool:
    """Append ``data`` unless ``app_id`` already committed ``version`` (or later).

    Returns whether a commit happened. Versions of one app must be appended in
    increasing order (the trainer's weight versions are).
    """
    done = committed_version(table_uri, app_id)
    if done is not None and done >= version:
        return False
    write_deltalake(
        table_uri,
        data,
        mode="append",
        schema_mode="merge",  # columns added in later releases extend older lakes
        partition_by=partition_by,
        commit_properties=CommitProperties(app_transactions=[Transaction(app_id, version)]),
    )
    return True


class Appender:
    """:func:`append_once` on one table, keeping the opened table between commits.

    Re-opening a table replays its log from the last checkpoint on every append; a
    long-running writer (the trainer commits on every published version) keeps the handle,
    which the write itself advances. Appends by other writers meanwhile are fine: Delta
    commits appends optimistically and this app's transaction version is only written here.
    """

    def __init__(self, table_uri: str, partition_by: list[str] | None = None) -> None:
        self.uri = table_uri
        self.partition_by = partition_by
        self._table: DeltaTable | None = None

    def _open(self) -> DeltaTable | None:
        if self._table is None and DeltaTable.is_deltatable(self.uri):
            self._table = DeltaTable(self.uri)
        return self._table

    def committed_version(self, app_id: str) -> int | None:
        table = self._open()
        return None if table is None else table.transaction_version(app_id)

    def append_once(self, data: pa.Table, *, app_id: str, version: int) -> bool:
        """Same contract as :func:`append_once`."""
        done = self.committed_version(app_id)
        if done is not None and done >= version:
            return False
        write_deltalake(
            self._table if self._table is not None else self.uri,
            data,
            mode="append",
            schema_mode="merge",
            partition_by=self.partition_by,
            commit_properties=CommitProperties(app_transactions=[Transaction(app_id, version)]),
        )
        if self._table is None:
            self._table = DeltaTable(self.uri)
        return True
