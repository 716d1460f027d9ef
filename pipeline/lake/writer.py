"""Idempotent Delta appends keyed by an application transaction (DESIGN.md §7 step 2).

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
        partition_by=partition_by,
        commit_properties=CommitProperties(app_transactions=[Transaction(app_id, version)]),
    )
    return True
