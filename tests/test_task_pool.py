"""The verified-task pool: which outcomes become candidates, the majority vote, the task's
fields, and the allow-list that guards a task's command (processors/task_pool.py,
task_commands.py). The real-broker run is in test_task_pool_broker.py."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys

import click
import pytest
from click.testing import CliRunner

from pipeline import events
from pipeline.events import Interaction, NextState
from pipeline.events.examples import interaction
from pipeline.processors.config import TaskSettings
from pipeline.processors.outcomes import GateResult, gate_event, outcome_event
from pipeline.processors.task_commands import allowed_argv, find_task
from pipeline.processors.task_pool import (
    TaskJoin,
    build_judges,
    checker_of,
    decide,
    majority,
    task_id,
)

BASE = interaction(8, 4)
PLUGINS = ["tests.toy_task_judges"]
WORDS = {"word-a": {"word": "fixed"}, "word-b": {"word": "tests"}, "word-c": {"word": "refactor"}}


def turn(sid: str, t: int, answer: str, prompt: str = "Fix the import error.",
         side: bool = False) -> Interaction:
    return dataclasses.replace(
        BASE, event_id=f"{sid}-i{t}", session_id=sid, turn=t, ts_ms=1000 + t,
        messages=[{"role": "system", "content": "You are an agent."},
                  {"role": "user", "content": prompt if t == 0 else f"and now step {t}"}],
        response_text=answer, turn_type="side" if side else "main", tool_calls=[])


def passed(sid: str, turn_: int | None = None) -> NextState:
    return outcome_event(sid, True, turn=turn_)


@pytest.mark.parametrize(("votes", "accepted"), [
    ([1, 1, -1], True),   # 2 of 3
    ([1, -1, -1], False),  # 1 of 3
    ([1, 1, 0], True),
    ([1, 0, 0], False),   # abstentions count against
    ([1], True),
    ([0], False),
    ([1, 1, 1, -1, -1], True),  # 3 of 5
    ([1, 1, 0, -1, 0], False),  # 2 of 5
])
def test_a_strict_majority_of_all_votes_accepts(votes: list[int], accepted: bool) -> None:
    assert majority(votes) is accepted


def test_an_outcome_joins_its_sessions_main_turns_in_either_order() -> None:
    j = TaskJoin()
    assert j.interaction(turn("s", 1, "second")) == []
    (c,) = j.outcome(passed("s"))  # session-scoped: every main turn so far
    assert [t.turn for t in c.turns] == [1]
    # the outcome first: it waits for a turn of its session
    j2 = TaskJoin()
    gate = passed("w")
    assert j2.outcome(gate) == []
    assert j2.interaction(turn("w", 0, "side", side=True)) == []  # side turns are no part
    (c2,) = j2.interaction(turn("w", 0, "main"))
    assert c2.outcome.state.event_id == gate.event_id
    assert j2.interaction(turn("w", 1, "later")) == []  # joined once
    assert c2.task_id == task_id("w", gate.event_id) == task_id("w", gate.event_id)
    assert task_id("w", gate.event_id) != task_id("w", "another-outcome")


def test_only_positive_verifiable_outcomes_of_the_prefix_count() -> None:
    j = TaskJoin(session_prefix="t-")
    for t in range(3):
        j.interaction(turn("t-1", t, f"answer {t}"))
    j.interaction(turn("other", 0, "x"))
    assert j.outcome(outcome_event("t-1", False)) == []  # a failed gate
    reply = dataclasses.replace(events.examples.examples()["next_state"], session_id="t-1")
    assert j.outcome(reply) == []  # a reply is evidence, not a verified outcome
    assert j.outcome(passed("other")) == []  # outside the prefix
    (c,) = j.outcome(passed("t-1", turn_=1))  # turn-scoped: the turns up to it
    assert [t.turn for t in c.turns] == [0, 1]
    fb = dataclasses.replace(outcome_event("t-1", True, kind="feedback"), exit_code=None,
                             score=0.5)
    (c2,) = j.outcome(fb)  # explicit positive feedback for the session: all three turns
    assert [t.turn for t in c2.turns] == [0, 1, 2]
    assert j.outcome(fb) == []  # the same outcome again: nothing


def test_three_judges_decide_the_task_and_it_carries_prompt_checker_provenance() -> None:
    judges = build_judges(["word-a", "word-b", "word-c"], WORDS, PLUGINS)
    j = TaskJoin()
    j.interaction(turn("s", 0, "Looking."), ("liverl.interactions.v1", 2, 40))
    j.interaction(turn("s", 1, "Fixed the import; the tests pass."),
                  ("liverl.interactions.v1", 2, 41))
    gate = gate_event("s", ["pytest", "-q"], GateResult(0, "3 passed", "", False, 1.5))
    (c,) = j.outcome(gate, ("liverl.next_states.v1", 2, 7))
    task = decide(c, judges)
    assert [v["vote"] for v in task.votes] == [1, 1, -1]  # "fixed", "tests", no "refactor"
    assert (task.status, task.k, task.task_id) == ("accepted", 3, c.task_id)
    assert task.prompt == "Fix the import error."  # the session's first user message
    assert task.answer == "Fixed the import; the tests pass."  # the final answer
    assert task.checker == {"kind": "command", "command": "pytest -q", "exit_code": 0,
                            "score": 1.0, "source": "record-outcome",
                            "content": "$ pytest -q\n3 passed", "producer": "record-outcome"}
    assert task.provenance == {
        "session_id": "s", "outcome_id": gate.event_id,
        "outcome_at": {"topic": "liverl.next_states.v1", "partition": 2, "offset": 7},
        "interactions": [
            {"event_id": "s-i0", "turn": 0, "topic": "liverl.interactions.v1",
             "partition": 2, "offset": 40},
            {"event_id": "s-i1", "turn": 1, "topic": "liverl.interactions.v1",
             "partition": 2, "offset": 41}]}
    assert events.decode(events.encode(task)) == task  # valid against its schema
    assert decide(c, judges).event_id == task.event_id  # deterministic
    # the same session answered otherwise: only "refactor" holds, 1 of 3
    j2 = TaskJoin()
    j2.interaction(turn("r", 0, "I refactored the module."))
    (c2,) = j2.outcome(passed("r"))
    rejected = decide(c2, judges)
    assert [v["vote"] for v in rejected.votes] == [-1, -1, 1]
    assert rejected.status == "rejected"
    assert checker_of(c2.outcome.state)["kind"] == "test_result"


def test_k_must_be_odd_and_the_judges_distinct() -> None:
    assert len(TaskSettings().judges) == 3
    with pytest.raises(ValueError, match="k must be odd"):
        TaskSettings(judges=["rules", "replies"])
    with pytest.raises(ValueError, match="named twice"):
        TaskSettings(judges=["rules", "rules", "replies"])


def _task(command: str | None) -> events.VerifiedTask:
    ex = events.examples.examples()["verified_task"]
    assert isinstance(ex, events.VerifiedTask)
    return dataclasses.replace(ex, checker={**ex.checker, "command": command})


def ran(command: str | None) -> dict[str, object]:
    """A checker of a command liverl ran (record-outcome -- CMD, gates run)."""
    return checker_of(gate_event("s", shlex.split(command) if command else [],
                                 GateResult(0, "", "", False, 1.0))) | {"command": command}


def test_allowed_commands_are_whole_argv_patterns() -> None:
    assert TaskSettings().allowed_commands == []  # nothing by default
    with pytest.raises(click.UsageError, match="matches no pattern.*the list is empty"):
        allowed_argv(ran("rm -rf /tmp/x"), [])
    tests = ["pytest -q 'tests/*'"]  # one glob per argument
    assert allowed_argv(ran("pytest -q 'tests/a b.py'"), tests) == ["pytest", "-q", "tests/a b.py"]
    for other in ("pytest -q tests/a.py -p evil", "pytest tests/a.py", "pytest -q src/a.py",
                  "rm -rf /tmp/x", "pytest -q"):
        with pytest.raises(click.UsageError, match="matches no pattern"):
            allowed_argv(ran(other), tests)  # an argument more, fewer, or another
    assert allowed_argv(ran("make check"), ["make check"]) == ["make", "check"]  # a whole line
    assert allowed_argv(ran("make"), ["make"]) == ["make"]
    with pytest.raises(click.UsageError, match="cut to fit"):
        allowed_argv(ran("pytest -q tests/…"), ["pytest -q *"])
    with pytest.raises(click.UsageError, match="not a command"):
        allowed_argv(ran(None), ["pytest"])


def test_a_bare_program_name_no_longer_allows_its_every_argument() -> None:
    """The issue's checker: python3 -c "open(...)" with allowed_commands = ["python3"]."""
    command = "python3 -c \"open('/tmp/x', 'w').write('x')\""
    with pytest.raises(click.UsageError) as info:
        allowed_argv(ran(command), ["python3", "pytest -q"])
    said = str(info.value)
    assert "(the entry 'python3' allows 'python3' run with no argument only)" in said
    assert "an entry is a whole command line, one shell glob per argument" in said
    assert "LIVERL_TASKS_ALLOWED_COMMANDS" not in said and '["python3"]' not in said


def test_an_allowed_commands_pattern_must_split() -> None:
    with pytest.raises(ValueError, match="cannot split the pattern"):
        TaskSettings(allowed_commands=["pytest -q 'tests"])
    with pytest.raises(ValueError, match="an empty pattern"):
        TaskSettings(allowed_commands=["pytest", "  "])
    assert TaskSettings(allowed_commands=["pytest -q 'tests/*'"]).allowed_commands == [
        "pytest -q 'tests/*'"]


def test_tasks_check_refuses_a_command_not_allowed_and_runs_one_that_is(
    monkeypatch: pytest.MonkeyPatch, tmp_path  # type: ignore[no-untyped-def]
) -> None:
    from pipeline.cli import cli
    from pipeline.processors import task_commands

    marker = tmp_path / "ran"
    script = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('x')"
    task = _task(shlex.join([sys.executable, "-c", script]))
    monkeypatch.setattr(task_commands, "_pool", lambda settings, ns: {task.task_id: task})
    env = {"LIVERL_STATE_DIR": str(tmp_path / "state")}
    res = CliRunner().invoke(cli, ["tasks", "check", task.task_id[:9]], env=env)
    assert res.exit_code == 2 and "matches no pattern" in res.output, res.output
    env["LIVERL_TASKS_ALLOWED_COMMANDS"] = json.dumps([sys.executable])  # the program: no more
    res = CliRunner().invoke(cli, ["tasks", "check", task.task_id], env=env)
    assert res.exit_code == 2 and "run with no argument only" in res.output, res.output
    assert not marker.exists()  # nothing ran
    env["LIVERL_TASKS_ALLOWED_COMMANDS"] = json.dumps([shlex.join([sys.executable, "-c", "*"])])
    res = CliRunner().invoke(cli, ["tasks", "check", task.task_id], env=env)
    assert res.exit_code == 0 and marker.read_text() == "x", res.output
    assert f"{task.task_id}: passed; recorded exit 0" in res.output
    res = CliRunner().invoke(cli, ["tasks", "show", "task-nope"], env=env)
    assert res.exit_code == 2 and "unknown task 'task-nope' (1 in the pool" in res.output


def posted(sid: str, command: str, source: str = "terminal") -> NextState:
    """A terminal next state as a client posts it to the gateway (the real source's event)."""
    from pipeline.serving.sources import SourceRequest, TerminalOptions
    from pipeline.serving.terminal_source import TerminalSource

    body = {"session_id": sid, "turn": 0, "command": command, "exit_code": 0, "output": "ok"}
    request = SourceRequest(body, None, "key-1", 10_000, lambda _: 0)
    (state,) = TerminalSource(TerminalOptions(source=source)).next_states(request)
    assert isinstance(state, NextState)
    return state


def test_a_command_posted_through_the_gateway_is_evidence_and_never_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path  # type: ignore[no-untyped-def]
) -> None:
    """The issue's task: a terminal next state with a command, exit code 0, accepted 2 of 3;
    `liverl tasks check` with the interpreter allowed ran it and wrote the file."""
    from pipeline.cli import cli
    from pipeline.processors import task_commands

    marker = tmp_path / "pwned"
    command = shlex.join([sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"])
    judges = build_judges(sorted(WORDS), WORDS, PLUGINS)
    env = {"LIVERL_STATE_DIR": str(tmp_path / "state")}
    for source in ("terminal", "record-outcome"):  # the source is the gateway's setting
        state = posted("g", command, source)
        assert (state.producer.component, state.kind) == ("gateway", "terminal")
        j = TaskJoin()
        j.interaction(turn("g", 0, "Fixed the tests."))
        (c,) = j.outcome(state)
        task = decide(c, judges)
        assert task.status == "accepted"  # still a verified outcome and the checker's vote
        monkeypatch.setattr(task_commands, "_pool", lambda settings, ns, t=task: {t.task_id: t})
        for allowed in ([sys.executable], [command], [shlex.join([sys.executable, "-c", "*"])]):
            env["LIVERL_TASKS_ALLOWED_COMMANDS"] = json.dumps(allowed)
            res = CliRunner().invoke(cli, ["tasks", "check", task.task_id], env=env)
            assert res.exit_code == 2, res.output
            assert "reported by a client through the gateway" in res.output
        assert not marker.exists()  # nothing from the event ran
        assert (task.checker["kind"], task.checker["command"]) == ("reported", None)
        assert task.checker["reported_command"] == command
        assert task.checker["producer"] == "gateway"
        assert events.decode(events.encode(task)) == task  # valid against its schema
    # the operator's own checker for it runs (an operator's, not the event's)
    mine = tmp_path / "mine"
    res = CliRunner().invoke(cli, ["tasks", "check", task.task_id, "--command", shlex.join(
        [sys.executable, "-c", f"open({str(mine)!r}, 'w').write('y')"])], env=env)
    assert res.exit_code == 0 and mine.read_text() == "y", res.output
    assert not marker.exists()


def test_a_command_checker_that_does_not_say_liverl_ran_it_is_not_run() -> None:
    """A task built before the checker kept its producer (or by hand): its command is not run,
    whatever the allow-list says."""
    old = {k: v for k, v in ran("pytest -q").items() if k != "producer"}
    with pytest.raises(click.UsageError, match="does not say liverl ran its command"):
        allowed_argv(old, ["pytest -q"])
    gateway = {**ran("pytest -q"), "producer": "gateway"}
    with pytest.raises(click.UsageError, match="does not say liverl ran its command"):
        allowed_argv(gateway, ["pytest -q"])
    # record-outcome's own event, whatever its --source: the command liverl ran
    labelled = gate_event("s", ["pytest", "-q"], GateResult(0, "", "", False, 1.0),
                          source="terminal")
    assert labelled.producer.component == "record-outcome" and labelled.source == "terminal"
    assert checker_of(labelled)["kind"] == "command"
    assert allowed_argv(checker_of(labelled), ["pytest -q"]) == ["pytest", "-q"]


def test_find_task_takes_a_unique_prefix() -> None:
    a, b = _task(None), _task(None)
    b = dataclasses.replace(b, task_id=a.task_id[:-1] + "0")
    pool = {a.task_id: a, b.task_id: b}
    assert find_task(pool, a.task_id) is a
    with pytest.raises(click.UsageError, match="ambiguous"):
        find_task(pool, a.task_id[:-1])
    with pytest.raises(click.UsageError, match="unknown task"):
        find_task(pool, "zzz")


@pytest.mark.parametrize(("answer", "votes", "status", "why"), [
    ("Fixed the import; the tests pass now.", [1, 1, 1], "accepted", "well-formed"),
    ("1.1.1.1.1.1.1.1.1.1", [-1, -1, 1], "rejected", "degenerate"),
    ("Fix the import error.", [-1, -1, 1], "rejected", "repeats the request"),
    ("I'm sorry, but I can't help with that.", [-1, -1, 1], "rejected", "a refusal"),
    # fluent but off the request's topic: one answer judge objects, the checker's vote stands
    ("The weather in Paris is lovely in spring.", [1, -1, 1], "accepted", "well-formed"),
])
def test_the_default_judges_read_the_answer_and_outvote_a_checker_on_junk(
    answer: str, votes: list[int], status: str, why: str
) -> None:
    """``tasks.judges`` = answer, on_topic, replies: a passed checker is one vote of three."""
    assert TaskSettings().judges == ["answer", "on_topic", "replies"]
    judges = build_judges(TaskSettings().judges)
    j = TaskJoin()
    j.interaction(turn("s", 0, answer))
    (c,) = j.outcome(passed("s"))
    task = decide(c, judges)
    assert [v["vote"] for v in task.votes] == votes and (task.status, task.k) == (status, 3)
    assert why in task.votes[0]["rationale"]
    assert "explicit score 1" in task.votes[2]["rationale"]  # replies reads the checker


def test_a_read_only_command_posted_through_the_gateway_verifies_nothing() -> None:
    """Issue 38: `git status` exiting 0, posted to POST /v1/next_states/terminal, was a verified
    outcome (score +1) and became a task on 7ed65b3. A pytest run still verifies."""
    from pipeline.processors.task_pool import TaskJoin, verified

    for command in ("git status", "ls -la && cat setup.py", "git log --oneline"):
        state = posted("s-ro", command)
        assert (state.exit_code, state.score, verified(state)) == (0, None, False)
        assert TaskJoin().outcome(state) == []
    assert verified(posted("s-ok", "pytest -q"))
