"""Namespace mapping (``names.resolve``) and where it is applied: settings, producer, consumer."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.kafka import names
from pipeline.replay import namespace as nsmod
from pipeline.replay.errors import NamespaceNameError
from pipeline.settings import Settings
from tests.conftest import create_topic


def test_resolve_live_and_namespace_round_trip() -> None:
    assert names.resolve(names.REWARDS, None) == names.REWARDS
    assert names.resolve(names.REWARDS, "") == names.REWARDS
    ns = names.resolve(names.REWARDS, "exp1")
    assert ns == "replay.exp1.liverl.rewards.v1"
    assert names.resolve(ns, "exp1") == ns  # idempotent: resolved names may be resolved again
    assert names.live(ns, "exp1") == names.REWARDS
    assert names.live(names.REWARDS, "exp1") == names.REWARDS
    assert names.namespace_of(ns) == "exp1"
    assert names.namespace_of(names.REWARDS) is None
    assert names.namespace_of("replay.") is None
    # group ids and Faust app ids take the same prefix
    assert names.resolve("liverl-rewards", "exp1") == "replay.exp1.liverl-rewards"
    # another namespace's name is not this one's: it gets this prefix too
    assert names.resolve("replay.a.liverl.hints.v1", "b") == "replay.b.replay.a.liverl.hints.v1"


def test_namespace_setting_validated_and_read_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIVERL_KAFKA_NAMESPACE", "rejudge-1")
    assert Settings().kafka.namespace == "rejudge-1"
    monkeypatch.setenv("LIVERL_KAFKA_NAMESPACE", "bad.name")
    with pytest.raises(ValidationError):
        Settings()
    monkeypatch.delenv("LIVERL_KAFKA_NAMESPACE")
    assert Settings().kafka.namespace is None
    with pytest.raises(NamespaceNameError, match="not a namespace name"):
        nsmod.check_name("a.b")


def test_enter_rebases_state_dir_once(tmp_path: Path) -> None:
    live = Settings(state_dir=tmp_path)
    ns = nsmod.enter(live, "exp")
    assert ns.kafka.namespace == "exp" and ns.state_dir == tmp_path / "replay" / "exp"
    assert nsmod.enter(ns, "exp").state_dir == ns.state_dir  # idempotent
    assert nsmod.enter(live, None) is live
    assert live.kafka.namespace is None and live.state_dir == tmp_path  # untouched copy


def test_namespace_specs_keep_partitions_and_key() -> None:
    settings = Settings()
    from pipeline.kafka.topics import load_specs

    live = {s.name: s for s in load_specs(settings.topics.specs_dir)}
    ns = nsmod.specs(settings, "exp")
    assert sorted(s.name for s in ns) == sorted(names.resolve(n, "exp") for n in live)
    for spec in ns:
        orig = live[names.live(spec.name, "exp")]
        assert (spec.partitions, spec.key, spec.value_schema) == (
            orig.partitions,
            orig.key,
            orig.value_schema,
        )
        assert spec.config["retention.ms"] == "-1"  # replayed timestamps are old


def test_trainer_settings_never_keep_live_roots(tmp_path: Path) -> None:
    from pipeline.trainer.config import TrainerSettings

    settings = nsmod.enter(Settings(state_dir=tmp_path), "exp")
    cfg = TrainerSettings(weights_root=Path("/live/weights"), lake_root=Path("/live/lake"))
    out = nsmod.trainer_settings(cfg, settings, typed={})
    assert out.input_topic == "replay.exp.liverl.samples.v1"
    assert out.weights_root == tmp_path / "replay" / "exp" / "weights"
    assert out.lake_root == tmp_path / "replay" / "exp" / "lake"
    typed = nsmod.trainer_settings(cfg, settings, typed={"weights_root": "/mine"})
    assert typed.weights_root == Path("/live/weights")  # given on the command line: kept


@pytest.mark.integration
def test_producer_and_consumer_map_topics_and_groups(kafka_settings, admin, unique) -> None:  # type: ignore[no-untyped-def]
    """A namespaced EventProducer writes the namespace's copy; a namespaced EventConsumer reads
    it under a namespaced group, and its records name the topic actually read."""
    from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition

    from pipeline import events
    from pipeline.events import examples
    from pipeline.kafka import EventConsumer, EventProducer

    live_topic = f"itest.names-{unique}.v1"
    ns = f"nm{unique}"
    ns_topic = names.resolve(live_topic, ns)
    create_topic(admin, live_topic)
    create_topic(admin, ns_topic)
    settings = nsmod.enter(kafka_settings, ns)
    try:
        producer = EventProducer(settings, client_id="names-test")
        event = examples.examples()["reward"]
        producer.send(live_topic, event)
        producer.flush()
        group = f"names-{unique}"
        consumer = EventConsumer(
            settings, group_id=group, topics=[live_topic], expected_types={live_topic: "reward"}
        )
        got = []
        for _ in range(60):
            batch = consumer.poll_batch(timeout=0.5)
            got += batch.records
            if got:
                consumer.commit(batch)
                break
        consumer.close()
        assert [r.topic for r in got] == [ns_topic]
        assert events.encode(got[0].event) == events.encode(event)
        probe = Consumer(kafka_settings.kafka_client_config(**{"group.id": f"probe-{unique}"}))
        assert probe.get_watermark_offsets(TopicPartition(live_topic, 0), 10)[1] == 0
        probe.close()
        ns_group = names.resolve(group, ns)
        req = [ConsumerGroupTopicPartitions(ns_group, [TopicPartition(ns_topic, 0)])]
        (fut,) = admin.list_consumer_group_offsets(req).values()
        assert [tp.offset for tp in fut.result(30).topic_partitions] == [1]
        groups = {g.group_id for g in admin.list_consumer_groups().result(30).valid}
        assert group not in groups and ns_group in groups
    finally:
        for fut in admin.delete_topics([live_topic, ns_topic]).values():
            fut.result(30)
        for fut in admin.delete_consumer_groups([names.resolve(f"names-{unique}", ns)]).values():
            fut.result(30)


def test_faust_app_in_a_namespace_declares_only_namespaced_names(tmp_path: Path) -> None:
    from pipeline.processors.app import create_app
    from pipeline.processors.config import ProcessorSettings

    settings = nsmod.enter(Settings(state_dir=tmp_path), "exp")
    app = create_app(settings, ProcessorSettings(web_enabled=False), settings.state_dir)
    assert app.conf.id == "replay.exp.liverl-rewards"
    declared = {n for t in app.liverl_topics.values() for n in t.topics}
    declared |= {tbl.changelog_topic.get_topic_name() for tbl in app.tables.values()}
    for agent in app.liverl_agents:
        declared |= set(agent.channel.topics)
    assert declared and all(n.startswith("replay.exp.") for n in declared), declared
    assert names.resolve(names.INTERACTIONS, "exp") in declared
    assert str(app.conf.datadir).startswith(str(tmp_path / "replay" / "exp"))
    live = create_app(Settings(), ProcessorSettings(web_enabled=False), tmp_path)
    assert live.conf.id == "liverl-rewards"
    live_names = {n for t in live.liverl_topics.values() for n in t.topics}
    assert {names.REWARDS, names.SAMPLES, names.DLQ} <= live_names
