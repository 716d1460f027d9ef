"""The processors' part of forget (processors/forget.py): the changelogs it reads are the
ones the real app declares, and over keys encoded as the agents encode them (records.py)
survey finds a session's live keys and erase tombstones exactly those."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from pipeline.kafka.reader import read_to_end
from pipeline.processors import forget as processors_forget
from pipeline.processors import records as R
from pipeline.processors.app import create_app
from pipeline.processors.config import ProcessorSettings
from pipeline.settings import Settings


def _app(tmp_path: Path, app_id: str, settings: Settings | None = None) -> Any:
    """The real app with every table (a judge that is not inline adds the judge's)."""
    cfg = ProcessorSettings(
        app_id=app_id, web_enabled=False, judge="llm", llm_base_url="http://127.0.0.1:9/v1"
    )
    return create_app(settings or Settings(), cfg, tmp_path)


def test_the_changelogs_are_those_faust_declares_for_the_apps_tables(tmp_path: Path) -> None:
    app = _app(tmp_path, "fg-app")
    declared = {t.changelog_topic.get_topic_name(): t.name for t in app.tables.values()}
    assert declared == processors_forget.changelog_names("fg-app")
    assert set(declared.values()) == set(R.TABLE_SESSION)
    present = {
        *declared,
        "fg-app-__assignor-__leader",
        "other-sessions-changelog",
        "replay.r1.fg-app-tokens-changelog",
        "replay.r1.liverl.interactions.v1",
    }
    assert processors_forget.changelog_topics("fg-app", present) == {
        **declared,
        "replay.r1.fg-app-tokens-changelog": R.TOKENS,
    }


def test_every_key_encoding_names_its_session() -> None:
    s = b"sess-1"
    assert R.TABLE_SESSION[R.SESSIONS](s) == s and R.TABLE_SESSION[R.JUDGING](s) == s
    assert R.TABLE_SESSION[R.TOKENS](R.token_key(s, 3)) == s
    assert R.TABLE_SESSION[R.PARKED](R.parked_key(s, "ns-9")) == s
    assert R.TABLE_SESSION[R.JUDGE_PARKED](R.parked_key(s, "ns-9")) == s
    assert R.TABLE_SESSION[R.GROUP_MEMBERS](R.member_key(b"g-1", "sess-1")) == s
    assert R.TABLE_SESSION[R.GROUP_MEMBERS](b"g-1") is None
    assert R.TABLE_SESSION[R.GROUPS](b"g-1") is None  # member ids only: left alone


def test_a_table_outside_the_list_is_refused(tmp_path: Path) -> None:
    from pipeline.processors.runtime import Runtime

    app = _app(tmp_path, "fg-refuse")
    rt = Runtime(
        app,
        Settings(state_dir=tmp_path),
        ProcessorSettings(),
        partitions=6,
        expected={},
        outputs=(),
    )
    with pytest.raises(ValueError, match="not in records.TABLE_SESSION"):
        rt.table("secrets")


def _latest(settings: Settings, topics: list[str]) -> dict[tuple[str, bytes], bytes | None]:
    out: dict[tuple[str, bytes], bytes | None] = {}

    def keep(m: Any) -> None:
        out[(m.topic(), m.key())] = m.value()

    read_to_end(settings, topics, keep, group_prefix="fg-verify-")
    return out


@pytest.mark.integration
def test_survey_finds_and_erase_tombstones_only_the_sessions_keys(
    kafka_settings: Settings, tmp_path: Path, unique: str
) -> None:
    from pipeline.processors.internal_topics import ensure_internal_topics

    app_id = f"fg-{unique}"
    app = _app(tmp_path, app_id, kafka_settings)
    ensure_internal_topics(app, kafka_settings)
    topics = processors_forget.changelog_names(app_id)
    topic = {table: t for t, table in topics.items()}
    records: list[tuple[str, bytes, bytes | None]] = []
    for sid in ("a", "b"):
        k = sid.encode()
        records += [
            (topic[R.SESSIONS], k, b'{"touched_ms": 1234}'),
            (topic[R.JUDGING], k, b'{"touched_ms": 99}'),
            (topic[R.TOKENS], R.token_key(k, 0), b"tokens"),
            (topic[R.TOKENS], R.token_key(k, 1), b"tokens"),
            (topic[R.TOKENS], R.token_key(k, 1), None),  # finished already
            (topic[R.PARKED], R.parked_key(k, "ns-1"), b"parked"),
            (topic[R.JUDGE_PARKED], R.parked_key(k, "ns-2"), b"parked"),
            (topic[R.GROUP_MEMBERS], R.member_key(b"g1", sid), b"[samples]"),
        ]
    records.append((topic[R.GROUPS], b"g1", b'{"members": ["a", "b"]}'))
    p = Producer(kafka_settings.kafka_client_config(**{"acks": "all"}))
    for t, key, value in records:  # where the agents place them: by session, groups by group
        p.produce(t, key=key, value=value, partition=R.key_partition(R.session_of(key), 6))
    assert p.flush(30) == 0
    present = set(topics)

    hits = processors_forget.survey(kafka_settings, app_id, ["a"], present)
    got = {topics[h.topic]: sorted(k for _, k in h.keys) for h in hits}
    assert got == {
        R.SESSIONS: [b"a"],
        R.JUDGING: [b"a"],
        R.TOKENS: [R.token_key(b"a", 0)],
        R.PARKED: [R.parked_key(b"a", "ns-1")],
        R.JUDGE_PARKED: [R.parked_key(b"a", "ns-2")],
        R.GROUP_MEMBERS: [R.member_key(b"g1", "a")],
    }
    assert {topics[h.topic]: h.touched_ms for h in hits if h.touched_ms} == {
        R.SESSIONS: 1234,
        R.JUDGING: 99,
    }
    for h in hits:  # a tombstone goes where the key's values are
        owner = b"g1" if topics[h.topic] == R.GROUP_MEMBERS else b"a"
        assert {p for p, _ in h.keys} == {R.key_partition(owner, 6)}

    assert processors_forget.erase(kafka_settings, hits) == 6
    latest = _latest(kafka_settings, list(topics))
    for t, key, value in records:
        owner = R.TABLE_SESSION[topics[t]](key)
        if owner == b"a":
            assert latest[(t, key)] is None, (t, key)
        elif value is not None and (t, key) != (topic[R.TOKENS], R.token_key(b"b", 1)):
            assert latest[(t, key)] == value, (t, key)
    assert processors_forget.survey(kafka_settings, app_id, ["a"], present) == []
    assert len(processors_forget.survey(kafka_settings, app_id, ["b"], present)) == 6
