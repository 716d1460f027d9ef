"""``liverl tap``: decoded events of a topic on the real broker, never committing offsets."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import orjson
import pytest
from click.testing import CliRunner

from pipeline import events
from pipeline.cli import cli
from pipeline.events.examples import examples
from pipeline.kafka.errors import TapError
from pipeline.kafka.tap import TapRow, parse_since, resolve_topic, short_name, summary
from pipeline.settings import Settings
from tests.conftest import create_topic

KNOWN = ["liverl.interactions.v1", "liverl.next_states.v1", "liverl.rewards.v1"]


def test_parse_since_durations_and_iso() -> None:
    now = 1_000_000_000_000
    assert parse_since("10m", now) == now - 600_000
    assert parse_since("2h", now) == now - 7_200_000
    assert parse_since("30s", now) == now - 30_000
    assert parse_since("2026-05-01T12:00:00Z") == 1777636800000
    assert parse_since("2026-05-01T12:00:00") == 1777636800000  # naive = UTC
    with pytest.raises(TapError, match="^--since: 'yesterday' is neither"):
        parse_since("yesterday")


def test_resolve_topic_full_short_and_unknown() -> None:
    assert resolve_topic("interactions", KNOWN) == "liverl.interactions.v1"
    assert resolve_topic("liverl.rewards.v1", KNOWN) == "liverl.rewards.v1"
    assert resolve_topic("replay.x.liverl.rewards.v1", KNOWN) == "replay.x.liverl.rewards.v1"
    assert short_name("liverl.next_states.v1") == "next_states"
    with pytest.raises(TapError, match="known topics: interactions"):
        resolve_topic("interaction", KNOWN)


def test_every_event_type_has_a_summary() -> None:
    for type_, event in examples().items():
        line = summary(TapRow("t", 0, 0, 0, None, event=event))
        assert line and not line.startswith("{"), type_  # not the generic JSON fallback
    vote = summary(TapRow("t", 0, 0, 0, None, event=examples()["gate_vote"]))
    assert vote == (
        "qwen3-4b-agent v13 vs v12 fluency held_out 9f2c4e1a7b3d vote +1 (-1.92 vs -2.31)"
    )


def test_bad_since_and_unknown_topic_exit_2() -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["tap", "interactions", "--since", "soon"])
    assert res.exit_code == 2 and "--since" in res.output
    res = runner.invoke(cli, ["tap", "nosuch"])
    assert res.exit_code == 2 and "liverl.interactions.v1" in res.output


def _next_state(session: str, turn: int, content: str) -> events.NextState:
    return events.NextState(
        event_id=events.new_event_id(),
        producer=events.Producer(component="test", version="0"),
        session_id=session,
        turn=turn,
        kind="user_reply",
        role="user",
        content=content,
        source="test",
        score=0.5 if turn % 2 else None,
    )


def _committed_groups(admin, topic: str, groups: set[str]) -> dict[str, int]:  # type: ignore[no-untyped-def]
    from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition

    out = {}
    for group in groups:
        req = [ConsumerGroupTopicPartitions(group, [TopicPartition(topic, 0)])]
        for fut in admin.list_consumer_group_offsets(req).values():
            res = fut.result(timeout=30)
            committed = [tp for tp in res.topic_partitions if tp.offset >= 0]
            if committed:
                out[group] = committed[0].offset
    return out


def _groups(admin) -> set[str]:  # type: ignore[no-untyped-def]
    result = admin.list_consumer_groups().result(timeout=30)
    return {g.group_id for g in result.valid}


@pytest.mark.integration
def test_tap_prints_filters_and_commits_nothing(
    kafka_settings: Settings,
    admin,  # type: ignore[no-untyped-def]
    unique: str,
) -> None:
    from pipeline.kafka import EventProducer

    # A replay-namespace-style name: not in topics/, confirmed by the broker, typed by suffix.
    topic = f"replay.tap{unique}.liverl.next_states.v1"
    create_topic(admin, topic, partitions=1)
    try:
        groups_before = _groups(admin)
        producer = EventProducer(kafka_settings, client_id=f"tap-test-{unique}")
        a, b = f"sa-{unique}", f"sb-{unique}"
        for turn in range(3):
            producer.send(topic, _next_state(a, turn, f"old {turn} of a"))
        producer.send(topic, _next_state(b, 0, "old of b"))
        producer.flush()
        time.sleep(1.2)
        cut = datetime.now(UTC).isoformat()
        time.sleep(1.2)
        producer.send(topic, _next_state(a, 3, "new 3 of a"))
        producer.send(topic, _next_state(b, 1, "new of b"))
        producer.send_raw(topic, b"not json at all", key=a)
        producer.flush()

        runner = CliRunner()
        res = runner.invoke(cli, ["tap", topic, "--format", "json"])
        assert res.exit_code == 0, res.output
        docs = [orjson.loads(line) for line in res.stdout.splitlines() if line.strip()]
        contents = [d.get("content") for d in docs]
        assert contents == [
            "old 0 of a", "old 1 of a", "old 2 of a", "old of b", "new 3 of a", "new of b", None
        ]  # fmt: skip
        assert [d["_kafka"]["offset"] for d in docs] == list(range(7))
        assert docs[0]["type"] == "next_state" and docs[0]["_kafka"]["key"] == a
        assert docs[-1]["type"] == "undecodable" and docs[-1]["value_head"] == "not json at all"

        res = runner.invoke(cli, ["tap", topic, "--session", a, "--format", "json"])
        assert res.exit_code == 0, res.output
        docs = [orjson.loads(line) for line in res.stdout.splitlines() if line.strip()]
        assert [d["_kafka"]["key"] for d in docs] == [a] * 5
        assert [d.get("turn") for d in docs] == [0, 1, 2, 3, None]

        res = runner.invoke(cli, ["tap", topic, "--since", cut, "--format", "json"])
        assert res.exit_code == 0, res.output
        docs = [orjson.loads(line) for line in res.stdout.splitlines() if line.strip()]
        assert [d.get("content") for d in docs] == ["new 3 of a", "new of b", None]

        res = runner.invoke(cli, ["tap", topic, "--limit", "2"], terminal_width=200)
        assert res.exit_code == 0, res.output
        assert "old 0 of a" in res.stdout and "old 1 of a" in res.stdout
        assert "old 2 of a" not in res.stdout
        assert "0@0" in res.stdout and "user_reply" in res.stdout and "next_state" in res.stdout

        res = runner.invoke(cli, ["tap", topic, "--since", "1s"], terminal_width=200)
        assert res.exit_code == 0, res.output  # nothing that recent: empty, not a hang

        # Nothing committed anywhere: no new group holds an offset on the topic.
        new_groups = _groups(admin) - groups_before
        assert not [g for g in new_groups if g.startswith("liverl-tap-")]
        assert _committed_groups(admin, topic, new_groups) == {}
    finally:
        for fut in admin.delete_topics([topic]).values():
            fut.result(timeout=30)


@pytest.mark.integration
def test_tap_missing_topic_on_broker(kafka_settings: Settings, unique: str) -> None:
    res = CliRunner().invoke(cli, ["tap", f"replay.none{unique}.liverl.rewards.v1"])
    assert res.exit_code == 2
    assert "no such topic" in res.output and "interactions" in res.output
