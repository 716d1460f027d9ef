"""Faust's internal topics (changelogs, the group repartition topic, the assignor's), created
before a worker starts and given compaction that keeps pace with the traffic."""

from __future__ import annotations

import logging
import time
from typing import Any

import faust

from pipeline.kafka.connection import Connectable, connection_of

log = logging.getLogger(__name__)


# Compaction that keeps pace with the traffic. A restarted worker reads its changelogs back
# from the start, and Kafka compacts only closed segments (7 days by default): after a busy
# hour a worker read ~125,000 records (a token payload and its tombstone per turn, several
# states per session) for ~40 s before its first turn. Segments now close every 10 minutes,
# the cleaner runs once 10 % of a log is stale, every value is compacted within the hour
# (also the bound `liverl forget` states) and a tombstone lives 10 minutes after it.
CHANGELOG_COMPACTION = {
    "segment.ms": str(10 * 60_000),
    "min.cleanable.dirty.ratio": "0.1",
    "max.compaction.lag.ms": str(60 * 60_000),
    "delete.retention.ms": str(10 * 60_000),
}


def ensure_internal_topics(app: faust.App, kafka: Connectable, timeout: float = 60.0) -> list[str]:
    """Create Faust's changelog and assignor topics before the worker starts.

    Faust declares them itself, but on a broker that is still electing coordinators it can
    miss one, log "Ignoring missing topic" and crash the agent on its first table write.
    Creating them up front (idempotently) makes a fresh ``liverl up`` deterministic.
    """
    from confluent_kafka.admin import AdminClient, NewTopic

    conn = connection_of(kafka)
    replication = app.conf.topic_replication_factor or 1  # create_app set it from [topics]
    # The size policy: a changelog carries token payloads and parked records of up to
    # kafka.max_event_bytes, which a cluster's default topic limit (1 MB) would refuse.
    size = {"max.message.bytes": str(conn.max_record_bytes)}
    wanted: dict[str, NewTopic] = {}
    compacted: list[str] = []
    for tbl in app.tables.values():
        ct = tbl.changelog_topic
        name = ct.get_topic_name()
        config = {"cleanup.policy": "compact" if ct.compacting else "delete", **size}
        if ct.compacting:
            config.update(CHANGELOG_COMPACTION)
            compacted.append(name)
        wanted[name] = NewTopic(
            name, ct.partitions or app.conf.topic_partitions, replication, config=config
        )
    for t in getattr(app, "liverl_topics", {}).values():  # our internal (repartition) topics
        if getattr(t, "internal", False):
            name = t.get_topic_name()
            parts = t.partitions or app.conf.topic_partitions
            config = {"cleanup.policy": "delete", **size}
            wanted[name] = NewTopic(name, parts, replication, config=config)
    leader = f"{app.conf.id}-__assignor-__leader"
    wanted[leader] = NewTopic(leader, 1, replication, config={"cleanup.policy": "compact"})
    admin = AdminClient(conn.client_config())
    existing = admin.list_topics(timeout=timeout).topics
    missing = [t for n, t in wanted.items() if n not in existing]
    _set_compaction(admin, [n for n in compacted if n in existing], timeout)
    if missing:
        for name, fut in admin.create_topics(missing, request_timeout=timeout).items():
            try:
                fut.result(timeout)
            except Exception as exc:  # noqa: BLE001 - another worker may have won the race
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise RuntimeError(f"cannot create internal topic {name}: {exc}") from exc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        present = admin.list_topics(timeout=timeout).topics
        if all(n in present for n in wanted):
            return [t.topic for t in missing]
        time.sleep(0.2)
    raise RuntimeError(f"internal topics not visible after {timeout:.0f}s: {sorted(wanted)}")


def _set_compaction(admin: Any, names_: list[str], timeout: float) -> None:
    """Give changelogs created before :data:`CHANGELOG_COMPACTION` its settings (an
    incremental change: other settings stay). Best effort: a principal without the right to
    alter topic configs still runs, with slower restarts, and is told so."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    if not names_:
        return
    resources = [
        ConfigResource(
            "topic",
            name,
            incremental_configs=[
                ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
                for k, v in CHANGELOG_COMPACTION.items()
            ],
        )
        for name in names_
    ]
    for res, fut in admin.incremental_alter_configs(resources, request_timeout=timeout).items():
        try:
            fut.result(timeout)
        except Exception as exc:  # noqa: BLE001 - restarts get slower, nothing breaks
            log.warning(
                "cannot set compaction settings of %s (%s): a restarted worker will "
                "read more of it back",
                res.name,
                exc,
            )
