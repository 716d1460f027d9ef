"""Gates file: checked whole before anything runs; ``liverl gates run`` records one outcome
for the gates (all must pass, each gate's result kept), a file of one gate exactly as
``liverl record-outcome -- CMD`` does, and exits with the first failure's code."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.events import NextState
from pipeline.processors import gates_file
from pipeline.processors.gates_file import GatesFileError, exit_code, load_gates, run_gates
from tests.test_processors_commands import _next_states_from_now

PY = sys.executable


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gates.yaml"
    path.write_text(text)
    return path


def exit_with(code: int, say: str = "") -> str:
    """A command as a YAML flow list (JSON is YAML)."""
    return json.dumps([PY, "-c", f"import sys; print({say!r}); sys.exit({code})"])


def test_a_string_command_is_split_like_sh_and_defaults_record_the_outcome(tmp_path):
    spec = load_gates(write(tmp_path, "gates:\n  - command: \"pytest -q -k 'a or b'\"\n"))
    (gate,) = spec.gates
    assert gate.argv == ["pytest", "-q", "-k", "a or b"]
    assert (gate.record_outcome, gate.timeout_s, gate.kind, gate.source) == (
        True, 1800.0, "test_result", "record-outcome"
    )  # fmt: skip
    assert spec.fail_fast is False and gate.label == "pytest -q -k 'a or b'"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("gates:\n  - command: ls\n    record: true\n", "gates.0.record: Extra inputs"),
        ("gates: []\n", "gates: List should have at least 1 item"),
        ("gate:\n  - command: ls\n", "gate: Extra inputs"),
        ("gates:\n  - command: ''\n", "empty command"),
        ('gates:\n  - command: "echo \'open"\n', "cannot split"),
        ("gates:\n  - command: ls\n    timeout_s: 0\n", "timeout_s: Input should be greater"),
        ("- command: ls\n", "expected a mapping"),
        ("gates: [\n", "not valid YAML"),
        ("gates:\n" + "  - command: ls\n" * 33, "at most 32 items"),
        ("gates:\n  - command: " + "x" * 1001 + "\n", "longer than 1000 characters"),
        ("gates:\n  - command: [" + ", ".join(["a"] * 257) + "]\n", "more than 256 arguments"),
        ("gates:\n  - command: ls\n    env: " + "[" * 6 + "]" * 6 + "\n", "deeper than 6"),
    ],
)
def test_a_bad_gates_file_is_an_error_naming_what_is_wrong(tmp_path, text, says):
    with pytest.raises(GatesFileError, match=None) as info:
        load_gates(write(tmp_path, text))
    assert says in str(info.value) and "gates.yaml" in str(info.value)


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(gates_file, "MAX_FILE_BYTES", 100)
    path = write(tmp_path, "gates:\n" + "  - command: ls\n" * 10)  # 7 + 10 * 16 = 167 bytes
    with pytest.raises(GatesFileError, match="167 bytes, more than the 100 allowed"):
        load_gates(path)
    with pytest.raises(GatesFileError, match="cannot read the gates file"):
        load_gates(tmp_path / "missing.yaml")


def alias_bomb(width: int = 110) -> str:
    """Four levels of ``width`` aliases each (``width``**4 strings named: 146 million at 110),
    nested no deeper than the file's depth limit: ~1.6 KB."""
    lines = ["a: &a [" + ", ".join(["lol"] * width) + "]"]
    for prev, cur in zip("abc", "bcd", strict=True):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * width) + "]")
    return "\n".join([*lines, "gates: [{command: ls}]", ""])


@pytest.mark.timeout(60)  # the walk of every alias path took minutes at full CPU
def test_an_alias_bomb_is_refused_as_it_is_read(tmp_path):
    text = alias_bomb()
    assert 1500 < len(text) < 1700
    with pytest.raises(GatesFileError) as info:
        load_gates(write(tmp_path, text))
    said = str(info.value)
    assert said == (
        f"{tmp_path / 'gates.yaml'}: line 1: anchor &a: YAML anchors and aliases "
        "are not allowed in a gates file (write each value out)"
    )
    assert "\n" not in said  # one line


def test_an_alias_is_refused_even_when_its_anchor_is_harmless(tmp_path):
    path = write(tmp_path, "gates:\n  - &t {command: ls}\n  - *t\n")
    with pytest.raises(GatesFileError, match="line 2: anchor &t: YAML anchors and aliases"):
        load_gates(path)
    assert load_gates(write(tmp_path, "gates:\n  - command: 'ls *a &b'\n")).gates[0].argv == [
        "ls",
        "*a",
        "&b",
    ]  # quoted: plain text, not YAML's


def test_run_gates_records_what_record_outcome_records_and_exits_with_the_first_failure(
    tmp_path,
):
    path = write(
        tmp_path,
        f"gates:\n  - command: {exit_with(0, 'ok')}\n"
        f"  - name: unit\n    command: {exit_with(3, 'boom')}\n    turn: 4\n"
        f"  - command: {exit_with(5)}\n    record_outcome: false\n"
        f"  - command: {exit_with(0)}\n",
    )
    sent: list[NextState] = []
    runs = run_gates(load_gates(path), "s-1", sent.append, echo=False)
    assert [r.result.exit_code for r in runs] == [0, 3, 5, 0]
    assert exit_code(runs) == 3  # the first failing gate's, not the last's
    # one outcome for the session's gates (both passed), one for the gate of turn 4; the
    # unrecorded gate is in neither
    assert [e.exit_code for e in sent] == [0, 3]
    session, unit = sent
    assert (session.scope, session.turn, session.score, session.kind) == (
        "session",
        0,
        1.0,
        "test_result",
    )
    assert [g["exit_code"] for g in session.detail["gates"]] == [0, 0]
    assert session.detail["rule"] == "all_must_pass" and session.detail["passed"] is True
    assert (unit.scope, unit.turn, unit.score, unit.detail["gate"]) == ("turn", 4, -1.0, "unit")
    assert "boom" in unit.detail["stdout_tail"] and unit.detail["passed"] is False
    assert runs[2].event is None and runs[0].event is runs[3].event is session


def test_a_failing_gate_then_a_passing_one_is_one_failed_outcome(tmp_path):
    """Issue 38: a failing pytest then a passing lint were two outcomes, and the last one
    recorded (+1) was the session's reward. All must pass: one outcome, failed."""
    path = write(
        tmp_path,
        f"gates:\n  - name: tests\n    command: {exit_with(1, '1 failed')}\n"
        f"  - name: lint\n    command: {exit_with(0, 'clean')}\n",
    )
    sent: list[NextState] = []
    run_gates(load_gates(path), "s-3", sent.append, echo=False)
    (outcome,) = sent
    assert (outcome.score, outcome.exit_code, outcome.detail["passed"]) == (-1.0, 1, False)
    assert [(g["gate"], g["passed"]) for g in outcome.detail["gates"]] == [
        ("tests", False),
        ("lint", True),
    ]  # each gate's own result, for the record
    assert "1 failed" in outcome.content and "clean" in outcome.content


def test_a_gate_that_could_not_run_makes_the_run_no_outcome(tmp_path):
    """A gate that is not found (127) is no outcome, not a failure; beside a passing gate the
    run verifies nothing (all must pass), beside a failing one it failed."""
    path = write(
        tmp_path, f"gates:\n  - command: liverl-no-such-gate-38\n  - command: {exit_with(0)}\n"
    )
    sent: list[NextState] = []
    runs = run_gates(load_gates(path), "s-4", sent.append, echo=False)
    assert [r.result.exit_code for r in runs] == [127, 0]
    (outcome,) = sent
    assert (outcome.score, outcome.exit_code, outcome.detail["passed"]) == (None, 127, None)
    assert outcome.detail["gates"][0]["no_outcome"] == "command not found"


def test_fail_fast_stops_and_a_failed_record_is_kept_as_the_runs_error(tmp_path):
    path = write(
        tmp_path,
        f"fail_fast: true\ngates:\n  - command: {exit_with(0)}\n"
        f"  - command: {exit_with(2)}\n  - command: {exit_with(0)}\n",
    )

    def down(event: NextState) -> None:
        raise RuntimeError("broker down")

    runs = run_gates(load_gates(path), "s-2", down, echo=False)
    assert [r.result.exit_code for r in runs] == [0, 2]  # the third never ran
    assert [r.error for r in runs] == ["broker down", "broker down"]
    assert exit_code(runs) == 2
    assert exit_code(runs[:1]) == 1  # all passed, one not recorded


def test_gates_check_prints_the_plan_and_a_usage_error_for_a_bad_file(tmp_path):
    path = write(tmp_path, "gates:\n  - name: tests\n    command: pytest -q\n")
    res = CliRunner().invoke(cli, ["gates", "check", "--file", str(path)])
    assert res.exit_code == 0, res.output
    assert "1. tests: pytest -q (records its outcome, timeout 1800 s)" in res.output
    bad = write(tmp_path, "gates:\n  - commands: pytest\n")
    res = CliRunner().invoke(cli, ["gates", "run", "--session", "s", "--file", str(bad)])
    assert res.exit_code == 2 and "gates.0.commands: Extra inputs" in res.output


def running(marker: str) -> list[int]:
    """Pids of live processes whose command line holds ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if marker.encode() in (proc / "cmdline").read_bytes():
                stat = (proc / "stat").read_bytes()
                if stat[stat.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X"):
                    found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def test_a_gate_whose_child_left_with_setsid_times_out_and_leaves_nothing_running(tmp_path):
    """The issue's gate: `setsid` exits 0 at once, its `sh` and `sleep` hold the output. It
    used to be reported passed after 10 s, the sleep left running."""
    marker = f"300.{os.getpid()}{time.monotonic_ns() % 10**6}"  # a sleep of its own
    path = write(
        tmp_path,
        f"gates:\n  - command: setsid sh -c 'sleep {marker}'\n"
        "    timeout_s: 2\n    record_outcome: false\n",
    )
    started = time.monotonic()
    try:
        res = CliRunner().invoke(cli, ["gates", "run", "--session", "s", "--file", str(path)])
        took = time.monotonic() - started
        left = running(marker)
    finally:
        for pid in running(marker):  # nothing of ours stays behind, whatever fails below
            os.kill(pid, signal.SIGKILL)
    assert res.exit_code == 124, res.output
    assert "timed out after 2 s (exit 124): no outcome; not recorded" in res.output
    assert "passed" not in res.output
    assert took < 8.0 and left == []


@pytest.mark.integration
def test_gates_run_records_one_combined_outcome_on_the_broker(kafka_settings, unique, tmp_path):
    """Two recorded gates (pass, fail 3) and an unrecorded one: one next state read back from
    the real topic, failed (all must pass) with each gate's result, and the run's exit code 3."""
    sid = f"gates-{unique}"
    path = write(
        tmp_path,
        f"gates:\n  - name: tests\n    command: {exit_with(0, '5 passed')}\n"
        f"  - command: {exit_with(3, '1 failed')}\n"
        f"  - command: {exit_with(0)}\n    record_outcome: false\n",
    )
    c = _next_states_from_now(kafka_settings, f"gr-{unique}")
    res = CliRunner().invoke(
        cli, ["gates", "run", "--session", sid, "--file", str(path)],
        obj={"settings": kafka_settings},
    )  # fmt: skip
    assert res.exit_code == 3, res.output
    assert "5 passed" in res.output and "1 failed" in res.output  # output passed through
    got: list[NextState] = []
    for _ in range(60):
        for msg in c.consume(100, timeout=0.5):
            if msg.error() is None and msg.key() == sid.encode():
                from pipeline import events

                got.append(events.decode(msg.value(), "next_state"))
        if len(got) >= 1:
            break
    c.close()
    assert [(e.exit_code, e.score, e.scope) for e in got] == [(3, -1.0, "session")]
    assert [g.get("gate") for g in got[0].detail["gates"]] == ["tests", None]
    assert "5 passed" in got[0].content and "1 failed" in got[0].content
    assert all(e.event_id in res.output for e in got)
    assert "not recorded (record_outcome: false)" in res.output
