"""Idempotent Delta appends keyed by an application transaction.

Step 2 of the publish protocol (docs/architecture.md#exactly-once-publishing).

Each append carries ``Transaction(app_id, version)`` in the same commit as the data, so
"was this batch written?" is answered atomically by the table itself: a retry after a crash
reads ``transaction_version(app_id)`` and skips what is already there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, WriterProperties, write_deltalake


@dataclass(eq=False)
class Appender:
    """Idempotent appends to one table, keeping the opened table between commits.

    Re-opening a table replays its log from the last checkpoint on every append; a
    long-running writer (the trainer commits on every published version) keeps the handle,
    which the write itself advances. Appends by other writers meanwhile are fine: Delta
    commits appends optimistically and this app's transaction version is only written here.
    """

    uri: str
    partition_by: list[str] | None = None
    _table: DeltaTable | None = field(default=None, init=False, repr=False)

    def _open(self) -> DeltaTable | None:
        if self._table is None and DeltaTable.is_deltatable(self.uri):
            self._table = DeltaTable(self.uri)
        return self._table

    def committed_version(self, app_id: str) -> int | None:
        table = self._open()
        return None if table is None else table.transaction_version(app_id)

    def append_once(self, data: pa.Table, *, app_id: str, version: int) -> bool:
        """Append ``data`` unless ``app_id`` already committed ``version`` (or later).

        Returns whether a commit happened. Versions of one app must be appended in
        increasing order (the trainer's weight versions are). New columns extend the table
        (``schema_mode="merge"``: columns added in later releases extend older lakes)."""
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


def append_with_transactions(
    target: str | DeltaTable,
    data: pa.Table,
    *,
    transactions: Mapping[str, int],
    partition_by: list[str] | None = None,
    writer_properties: WriterProperties | None = None,
) -> None:
    """Append ``data`` with every ``(app_id, version)`` of ``transactions`` in one commit.

    For a writer whose batch covers several sources at once (an archive commit spans the
    partitions of a topic): each source keeps its own progress, all made durable together
    with the rows. Checking which versions are already committed is the caller's job; a
    concurrent commit that recorded one of the same app ids first makes this one fail with
    ``deltalake.exceptions.CommitFailedError`` (delta-rs' conflict check), so two writers
    can never both append the same version.
    """
    # deltalake's overloads omit the None that its implementation takes (and defaults to).
    write_deltalake(  # type: ignore[call-overload]
        target,
        data,
        mode="append",
        schema_mode="merge",
        partition_by=partition_by,
        writer_properties=writer_properties,
        commit_properties=CommitProperties(
            app_transactions=[Transaction(app, version) for app, version in transactions.items()]
        ),
    )


@dataclass(eq=False)
class MultiAppender(Appender):
    """An :class:`Appender` whose commits carry several application transactions."""

    writer_properties: WriterProperties | None = None

    def refresh(self) -> None:
        """Load commits made by other writers since the handle was opened or last written."""
        if self._table is not None:
            self._table.update_incremental()
        else:
            self._open()

    def ensure(self, schema: pa.Schema) -> DeltaTable:
        """The opened table, created empty first when there is none.

        Appends then always go through a handle with a read version: delta-rs checks a
        commit that creates a table against nothing, so two writers creating it at once
        would both commit their rows (seen in tests). Two empty creations racing both
        succeed (versions 0 and 1), which is harmless.
        """
        table = self._open()
        if table is None:
            DeltaTable.create(
                self.uri, schema=schema, partition_by=self.partition_by, mode="ignore"
            )
            table = self._open()
            assert table is not None
        return table

    def committed_versions(self, app_ids: Iterable[str]) -> dict[str, int | None]:
        return {app: self.committed_version(app) for app in app_ids}

    def append_once_many(self, data: pa.Table, *, transactions: Mapping[str, int]) -> bool:
        """Append ``data`` with all ``transactions`` unless every one is already committed.

        Returns whether a commit happened. Some committed and others not means the rows mix
        written and unwritten sources: ValueError, the caller must drop the written rows
        first. Raises ``CommitFailedError`` when another writer committed one of these app
        ids since this handle last looked (call :meth:`refresh`, drop, retry).
        """
        table = self.ensure(data.schema)
        done = self.committed_versions(transactions)
        already = {a for a, v in transactions.items() if (d := done[a]) is not None and d >= v}
        if already and len(already) == len(transactions):
            return False
        if already:
            raise ValueError(f"already committed: {sorted(already)}; drop their rows first")
        append_with_transactions(
            table,
            data,
            transactions=transactions,
            partition_by=self.partition_by,
            writer_properties=self.writer_properties,
        )
        return True
