"""The ``liverl workers``/``record-outcome`` commands, and the judge stage's waiting room."""

from __future__ import annotations

import dataclasses
import shlex
import sys

import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer, TopicPartition

from pipeline import events
from pipeline.kafka import names
from pipeline.processors import judging
from pipeline.processors.commands import GateResult, gate_event, record_outcome, run_gate, workers
from tests.support import examples


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


def _next_states_from_now(kafka_settings, group: str) -> Consumer:  # type: ignore[no-untyped-def]
    c = Consumer(kafka_settings.kafka_client_config(**{"group.id": group}))
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
    return c


def _one_for(c: Consumer, sid: str):  # type: ignore[no-untyped-def]
    found = None
    for _ in range(60):
        for msg in c.consume(100, timeout=0.5):
            if msg.error() is None and msg.key() == sid.encode():
                found = events.decode(msg.value(), "next_state")
        if found:
            break
    c.close()
    return found


@pytest.mark.integration
def test_record_outcome_produces_a_session_scoped_next_state(kafka_settings, unique):
    sid = f"outcome-{unique}"
    c = _next_states_from_now(kafka_settings, f"o-{unique}")
    result = CliRunner().invoke(
        record_outcome,
        ["--session", sid, "--failed", "--detail", "2 tests failed"],
        obj={"settings": kafka_settings},
    )
    assert result.exit_code == 0, result.output
    found = _one_for(c, sid)
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


# ---- record-outcome -- CMD: a quality gate run, its exit code recorded and passed through -------

PY = sys.executable


def test_a_gate_keeps_its_exit_code_and_the_ends_of_its_output():
    ok = run_gate([PY, "-c", "print('3 passed')"], 30, echo=False)
    assert (ok.exit_code, ok.stdout_tail.strip(), ok.stderr_tail, ok.timed_out) == (
        0, "3 passed", "", False
    )
    code = "import sys; print('x' * 9000 + 'END'); print('E boom', file=sys.stderr); sys.exit(3)"
    bad = run_gate([PY, "-c", code], 30, tail_chars=100, echo=False)
    assert bad.exit_code == 3 and bad.stderr_tail.strip() == "E boom"
    assert len(bad.stdout_tail) == 100 and bad.stdout_tail.strip().endswith("END")


def test_a_gate_past_its_timeout_is_killed_and_fails():
    slow = run_gate([PY, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                    1.0, echo=False)
    assert (slow.exit_code, slow.timed_out) == (124, True)
    assert slow.stdout_tail.strip() == "started" and slow.duration_s < 30


def test_a_missing_gate_command_is_127():
    missing = run_gate(["/no/such/gate-command"], 5, echo=False)
    assert missing.exit_code == 127 and "gate-command" in missing.stderr_tail


def test_gate_event_carries_the_verdict_and_the_tails():
    gate = GateResult(2, "collected 4\n1 failed", "warning", False, 1.5)
    ev = gate_event("s", ["pytest", "-q", "tests/x y.py"], gate, turn=3)
    assert (ev.kind, ev.turn, ev.scope) == ("test_result", 3, "turn")
    assert (ev.exit_code, ev.score) == (2, -1.0)
    assert ev.content == "$ pytest -q 'tests/x y.py'\ncollected 4\n1 failed\n[stderr]\nwarning"
    assert ev.detail["command"] == "pytest -q 'tests/x y.py'" and ev.detail["passed"] is False
    assert (ev.detail["stdout_tail"], ev.detail["timed_out"]) == ("collected 4\n1 failed", False)
    passed = gate_event("s", ["true"], GateResult(0, "", "", False, 0.1))
    assert (passed.exit_code, passed.score, passed.scope) == (0, 1.0, "session")


@pytest.mark.parametrize(
    "args",
    [["--session", "s"], ["--session", "s", "--passed", "--", PY, "-c", "pass"]],
)
def test_record_outcome_needs_a_verdict_or_a_command_not_both(args):
    result = CliRunner().invoke(record_outcome, args)
    assert result.exit_code == 2 and "--passed/--failed" in result.output


@pytest.mark.integration
@pytest.mark.parametrize(
    ("code", "exit_code", "stream"),
    [
        ("print('all 5 passed')", 0, "all 5 passed"),
        ("import sys; print('AssertionError', file=sys.stderr); sys.exit(3)", 3, "AssertionError"),
    ],
)
def test_record_outcome_runs_the_gate_and_records_it(kafka_settings, unique, code, exit_code,
                                                      stream):
    sid = f"gate-{unique}"
    c = _next_states_from_now(kafka_settings, f"g-{unique}")
    result = CliRunner().invoke(
        record_outcome,
        ["--session", sid, "--turn", "2", "--timeout", "60", "--", PY, "-c", code],
        obj={"settings": kafka_settings},
    )
    assert result.exit_code == exit_code, result.output  # the gate's code passes through
    assert stream in result.output  # its output passed through too
    found = _one_for(c, sid)
    assert found is not None and found.event_id in result.output
    assert (found.kind, found.turn, found.scope, found.exit_code) == (
        "test_result", 2, "turn", exit_code
    )
    assert found.score == (1.0 if exit_code == 0 else -1.0)
    assert found.detail["passed"] is (exit_code == 0)
    tails = found.detail["stdout_tail"] + found.detail["stderr_tail"]
    assert stream in tails and stream in found.content
    assert found.detail["command"] == shlex.join([PY, "-c", code])
