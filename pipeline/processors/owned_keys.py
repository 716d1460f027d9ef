"""A worker's tables hold only the keys of the partitions it owns.

Faust's in-memory store forgets a revoked partition's keys after a rebalance only when they
were restored from the changelog (``faust/stores/memory.py`` tracks a key's partition in
``apply_changelog_batch`` alone). A key this worker wrote itself stays in memory after its
partition moves to another worker, and every timer that walks a table (the idle sweep, grace
assembly, expiry, orphan cleanup) would act on it: publish a session that another worker now
owns, write a stale copy of its state over the owner's, delete the owner's parked records.
A soak (``bench/eos_soak.py``) saw 18 such keys in one worker after a single rebalance.

So after every recovery each table drops, **from memory only** (never a tombstone on the
changelog, which belongs to the new owner), every key whose partition is not among the
table's active partitions. A partition that comes back is restored whole from its changelog
(Faust forgets a revoked partition's recovery offset), so nothing of it is lost here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Set
from typing import Any

from faust.types import TP, TableT

log = logging.getLogger(__name__)


def drop_foreign(table: TableT, partition_of: Callable[[Any], int], owned: Set[int]) -> int:
    """Forget, in memory, the keys of ``table`` whose partition is not in ``owned``; the
    number dropped."""
    store = table.data
    data = getattr(store, "data", None)
    if not isinstance(data, dict):  # not Faust's memory store: it keeps partitions itself
        return 0
    foreign = [key for key in data if partition_of(key) not in owned]
    where = getattr(store, "_key_partition", {})
    for key in foreign:
        data.pop(key, None)
        where.pop(key, None)
    if foreign:
        log.info("table %s: forgot %d keys of partitions this worker no longer owns",
                 table.name, len(foreign))  # fmt: skip
    return len(foreign)


def keep_owned_only(table: TableT, partition_of: Callable[[Any], int]) -> None:
    """After each recovery of ``table``, :func:`drop_foreign` the keys of partitions it does
    not hold active (see the module docstring)."""
    recovered = table.on_recovery_completed

    async def on_recovery_completed(active_tps: set[TP], standby_tps: set[TP]) -> None:
        await recovered(active_tps, standby_tps)
        drop_foreign(table, partition_of, {tp.partition for tp in active_tps})

    table.on_recovery_completed = on_recovery_completed  # type: ignore[method-assign]
