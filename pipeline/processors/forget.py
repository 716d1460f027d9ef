"""The processors' part of ``liverl forget``: sessions' state in the tables' changelogs.

Every table is changelogged to a compacted topic that Faust names for the app id (live and
in each replay namespace); a worker recovers its tables from them, so a session's state is
forgotten by a tombstone for each of its keys. Which tables there are and how each key names
its session is :data:`.records.TABLE_SESSION`, the list the agents declare their tables
from; the topic names are Faust's own (:func:`changelog_topics`), never restated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.errors import ForgetError
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable, connection_of
from pipeline.kafka.reader import read_to_end

from .records import JUDGING, SESSIONS, TABLE_SESSION, touched

GROUP_PREFIX = "liverl-forget-"  # the one-shot reader's throwaway group id


@dataclass
class ChangelogHit:
    topic: str
    keys: list[tuple[int, bytes]]  # (partition, key) whose latest value is not a tombstone
    touched_ms: int = 0  # newest touched_ms among the session states (0: unknown)


def changelog_names(app_id: str) -> dict[str, str]:
    """changelog topic -> table, for every table of the app ``app_id``, as Faust names them
    (a bare app declaring the tables: nothing is started or connected)."""
    import faust

    app = faust.App(app_id, store="memory://", autodiscover=False)
    out = {}
    for table in TABLE_SESSION:
        declared = app.Table(table, default=None, key_type=bytes, value_type=bytes)
        out[declared.changelog_topic.get_topic_name()] = table
    return out


def changelog_topics(app_id: str, present: set[str]) -> dict[str, str]:
    """changelog topic -> table, of the processors app ``app_id`` (the live one and its copy
    in every replay namespace ``present`` shows), for the topics in ``present``."""
    namespaces = sorted({ns for t in present if (ns := names.namespace_of(t))})
    out: dict[str, str] = {}
    for app in (app_id, *(names.resolve(app_id, ns) for ns in namespaces)):
        out.update(changelog_names(app))
    return {t: out[t] for t in sorted(present) if t in out}


def survey(
    connection: Connectable, app_id: str, sessions: list[str], present: set[str]
) -> list[ChangelogHit]:
    """Per changelog of ``app_id``: the sessions' keys whose latest value is not a tombstone
    (read to the end of each topic as it was when the survey began)."""
    wanted = {s.encode() for s in sessions}
    tables = changelog_topics(app_id, present)
    latest: dict[tuple[str, int, bytes], bytes | None] = {}

    def handle(m: Any) -> None:
        key = m.key()
        if key is not None and TABLE_SESSION[tables[m.topic()]](key) in wanted:
            latest[(m.topic(), m.partition(), key)] = m.value()

    read_to_end(connection, tables, handle, group_prefix=GROUP_PREFIX)
    hits: dict[str, ChangelogHit] = {t: ChangelogHit(t, []) for t in tables}
    for (topic, partition, key), value in sorted(latest.items()):
        if value is None:
            continue  # already a tombstone
        hit = hits[topic]
        hit.keys.append((partition, key))
        if tables[topic] in (SESSIONS, JUDGING):
            hit.touched_ms = max(hit.touched_ms, touched(value))
    return [h for h in hits.values() if h.keys]


def erase(connection: Connectable, hits: list[ChangelogHit], timeout_s: float = 30.0) -> int:
    """A null value for each key, on the partition where its values are: compaction then
    drops the values, and a worker recovering the table no longer sees the session. Returns
    the tombstones sent; raises :class:`ForgetError` unless every one was acknowledged."""
    from confluent_kafka import Producer

    kafka = connection_of(connection)
    producer = Producer(kafka.client_config(**{"enable.idempotence": True, "acks": "all"}))
    errors: list[str] = []

    def delivered(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(f"{msg.topic()}[{msg.partition()}]: {err}")

    sent = 0
    for hit in hits:
        for partition, key in hit.keys:
            producer.produce(
                hit.topic, key=key, value=None, partition=partition, on_delivery=delivered
            )
            producer.poll(0)
            sent += 1
    left = producer.flush(timeout_s)
    if left or errors:
        raise ForgetError(
            f"{left + len(errors)} of {sent} changelog tombstones were not delivered "
            f"({'; '.join(errors[:3]) or 'timeout'}); run forget again"
        )
    return sent
