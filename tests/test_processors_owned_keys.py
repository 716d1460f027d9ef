"""After a recovery a worker's tables hold only the keys of partitions it owns
(owned_keys.py): the keys it wrote itself before a partition moved are forgotten in memory,
never deleted on the changelog; the app keeps no standby copies in its tables."""

from __future__ import annotations

import asyncio
from pathlib import Path

from faust.types import TP

from pipeline.processors.app import create_app
from pipeline.processors.config import ProcessorSettings
from pipeline.processors.owned_keys import drop_foreign
from pipeline.processors.records import key_partition, parked_key
from pipeline.settings import Settings


def _app(tmp_path: Path):  # type: ignore[no-untyped-def]
    app = create_app(Settings(), ProcessorSettings(web_enabled=False), tmp_path)
    app.finalize()
    return app


def _keys_by_partition(partitions: int, per: int = 2) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {p: [] for p in range(partitions)}
    i = 0
    while any(len(v) < per for v in out.values()):
        key = f"s-{i}".encode()
        p = key_partition(key, partitions)
        if len(out[p]) < per:
            out[p].append(key)
        i += 1
    return out


def _table(app, name: str):  # type: ignore[no-untyped-def]
    return next(t for t in app.tables.values() if t.name == name)


def test_the_app_keeps_no_standby_copies(tmp_path: Path) -> None:
    # A standby's records went into the same in-memory table the timers walk.
    assert _app(tmp_path).conf.table_standby_replicas == 0


def test_recovery_forgets_live_written_keys_of_revoked_partitions_in_memory_only(
    tmp_path: Path,
) -> None:
    app = _app(tmp_path)
    sessions = _table(app, "sessions")
    n = app.conf.topic_partitions
    keys = _keys_by_partition(n)
    sent: list[object] = []
    sessions.send_changelog = lambda *a, **k: sent.append(a)  # type: ignore[method-assign]
    store = sessions.data
    for part_keys in keys.values():
        for key in part_keys:
            store.data[key] = b"state"  # written live: Faust's store keeps no partition for it
    recovered = keys[0][0]
    store._key_partition[recovered] = 0  # restored from the changelog
    topic = sessions.changelog_topic.get_topic_name()
    owned = {1, 3}

    asyncio.run(sessions.on_recovery_completed({TP(topic, p) for p in owned}, set()))

    assert set(store.data) == {k for p in owned for k in keys[p]}
    assert recovered not in store._key_partition
    assert sent == []  # the changelog belongs to the partition's new owner


def test_session_keyed_tables_place_keys_by_their_session(tmp_path: Path) -> None:
    app = _app(tmp_path)
    parked = _table(app, "parked")
    n = app.conf.topic_partitions
    keys = _keys_by_partition(n, per=1)
    store = parked.data
    for p, (sid,) in keys.items():
        store.data[parked_key(sid, f"ns-{p}")] = b"parked"
    topic = parked.changelog_topic.get_topic_name()

    asyncio.run(parked.on_recovery_completed({TP(topic, 2)}, set()))

    assert list(store.data) == [parked_key(keys[2][0], "ns-2")]


def test_a_worker_that_owns_nothing_forgets_everything(tmp_path: Path) -> None:
    app = _app(tmp_path)
    groups = _table(app, "groups")
    groups.data.data.update({b"g-1": b"x", b"g-2": b"y"})
    assert drop_foreign(groups, lambda key: 0, set()) == 2
    assert dict(groups.data.data) == {}
