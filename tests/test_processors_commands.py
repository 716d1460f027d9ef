"""The click commands the lead wires into ``liverl``, and the judge stage's waiting room."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.events import examples
from pipeline.kafka import names
from pipeline.processors import judging
from pipeline.processors.commands import record_outcome, workers


def test_workers_help_names_the_knobs():
    result = CliRunner().invoke(workers, ["--help"])
    assert result.exit_code == 0
    for opt in ("--app-id", "--web-port", "--no-web", "--judge", "--rules"):
        assert opt in result.output


def test_workers_rejects_invalid_rules(tmp_path):
    bad = tmp_path / "rules.yaml"
    bad.write_text(
        "version: v\nbeta: 2.0\nrules:\n  - {id: x, kind: forbidden_pattern, patterns: [rm],"
        " penalty: 0.5, compliance: 0.1}\n"
    )
    result = CliRunner().invoke(workers, ["--rules", str(bad), "--no-web"])
    assert result.exit_code != 0
    assert "inaction trap" in result.output


@pytest.mark.integration
def test_record_outcome_produces_a_session_scoped_next_state(kafka_settings, unique):
    sid = f"outcome-{unique}"
    c = Consumer(kafka_settings.kafka_client_config(**{"group.id": f"o-{unique}"}))
    parts = c.list_topics(names.NEXT_STATES, timeout=10).topics[names.NEXT_STATES].partitions
    c.assign(
        [
            TopicPartition(
                names.NEXT_STATES,
                p,
                c.get_watermark_offsets(TopicPartition(names.NEXT_STATES, p), timeout=10)[1],
            )
            for p in parts
        ]
    )
    result = CliRunner().invoke(
        record_outcome,
        ["--session", sid, "--failed", "--detail", "2 tests failed"],
        obj={"settings": kafka_settings},
    )
    assert result.exit_code == 0, result.output
    found = None
    for _ in range(60):
        for msg in c.consume(100, timeout=0.5):
            if msg.error() is None and msg.key() == sid.encode():
                found = events.decode(msg.value(), "next_state")
        if found:
            break
    c.close()
    assert found is not None
    assert (found.kind, found.exit_code, found.score, found.content) == (
        "test_result",
        1,
        -1.0,
        "2 tests failed",
    )
    assert (found.scope, found.detail) == ("session", {"passed": False})
    assert found.event_id in result.output


def test_next_state_waits_for_its_turn_then_expires():
    ns = dataclasses.replace(examples.examples()["next_state"], event_id="n1", turn=3)
    state, todo = judging.on_next_state(None, ns, now_ms=1_000)
    assert judging.take_ready(state, todo[0]) is None  # turn 3 unknown yet
    assert judging.expired(state, 1_500, 1_000) == []
    assert judging.expired(state, 2_001, 1_000) == ["n1"]
    inter = examples.interaction(prompt_tokens=2, response_tokens=1)  # turn 3 of the session
    state = judging.on_interaction(state, inter)
    work = judging.take_ready(state, ns)
    assert work is not None and work.interaction_id == inter.event_id
    assert work.ctx.request.startswith("The CI job `unit` fails")
    assert state["pending"] == {}


def test_state_retention_must_outlive_live_sessions():
    from pipeline.processors.config import ProcessorSettings

    with pytest.raises(ValueError, match="retain_s"):
        ProcessorSettings(idle_timeout_s=600, grace_s=30, retain_s=600)
    assert ProcessorSettings(idle_timeout_s=600, grace_s=30, retain_s=631).retain_s == 631
