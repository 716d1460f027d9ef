"""The verified-task pool: which outcomes become candidates, the majority vote, the task's
fields, and the allow-list that guards a task's command (processors/task_pool.py,
task_commands.py). The real-broker run is in test_task_pool_broker.py."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipeline import events
from pipeline.events import Interaction, NextState
from pipeline.events.examples import interaction
from pipeline.processors.config import TaskSettings
from pipeline.processors.outcomes import GateResult, gate_event, outcome_event
from pipeline.processors.task_commands import allowed_argv, find_task, success_rate
from pipeline.processors.task_pool import (
    TaskJoin,
    build_judges,
    checker_of,
    decide,
    majority,
    revise,
    task_id,
)

BASE = interaction(8, 4)
PLUGINS = ["tests.toy_task_judges"]
WORDS = {"word-a": {"word": "fixed"}, "word-b": {"word": "tests"}, "word-c": {"word": "refactor"}}


def turn(
    sid: str, t: int, answer: str, prompt: str = "Fix the import error.", side: bool = False
) -> Interaction:
    return dataclasses.replace(
        BASE,
        event_id=f"{sid}-i{t}",
        session_id=sid,
        turn=t,
        ts_ms=1000 + t,
        messages=[
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": prompt if t == 0 else f"and now step {t}"},
        ],
        response_text=answer,
        turn_type="side" if side else "main",
        tool_calls=[],
    )


def passed(sid: str, turn_: int | None = None) -> NextState:
    return outcome_event(sid, True, turn=turn_)


@pytest.mark.parametrize(
    ("votes", "accepted"),
    [
        ([1, 1, -1], True),  # 2 of 3
        ([1, -1, -1], False),  # 1 of 3
        ([1, 1, 0], True),
        ([1, 0, 0], False),  # abstentions count against
        ([1], True),
        ([0], False),
        ([1, 1, 1, -1, -1], True),  # 3 of 5
        ([1, 1, 0, -1, 0], False),  # 2 of 5
    ],
)
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
    later = c.outcome.state.ts_ms + 1000
    fb = dataclasses.replace(
        outcome_event("t-1", True, kind="feedback", ts_ms=later), exit_code=None, score=0.5
    )
    # explicit positive feedback for the session: was a second task of all three turns; a
    # session is one task now, the feedback one more of its outcomes
    (c2,) = j.outcome(fb)
    assert c2.task_id == c.task_id and [t.turn for t in c2.turns] == [0, 1]
    assert [(r["outcome_id"], r["vote"], r["turn"]) for r in c2.record] == [
        (c.outcome.state.event_id, 1, 1),
        (fb.event_id, 1, None),
    ]
    assert j.outcome(fb) == []  # the same outcome again: nothing


def test_three_judges_decide_the_task_and_it_carries_prompt_checker_provenance() -> None:
    judges = build_judges(["word-a", "word-b", "word-c"], WORDS, PLUGINS)
    j = TaskJoin()
    j.interaction(turn("s", 0, "Looking."), ("liverl.interactions.v1", 2, 40))
    j.interaction(
        turn("s", 1, "Fixed the import; the tests pass."), ("liverl.interactions.v1", 2, 41)
    )
    gate = gate_event("s", ["pytest", "-q"], GateResult(0, "3 passed", "", False, 1.5))
    (c,) = j.outcome(gate, ("liverl.next_states.v1", 2, 7))
    task = decide(c, judges)
    assert [v["vote"] for v in task.votes] == [1, 1, -1]  # "fixed", "tests", no "refactor"
    assert (task.status, task.k, task.task_id) == ("accepted", 3, c.task_id)
    assert task.prompt == "Fix the import error."  # the session's first user message
    assert task.answer == "Fixed the import; the tests pass."  # the final answer
    assert task.checker == {
        "kind": "command",
        "command": "pytest -q",
        "exit_code": 0,
        "score": 1.0,
        "source": "record-outcome",
        "content": "$ pytest -q\n3 passed",
        "producer": "record-outcome",
    }
    assert task.provenance == {
        "session_id": "s",
        "outcome_id": gate.event_id,
        "outcome_at": {"topic": "liverl.next_states.v1", "partition": 2, "offset": 7},
        "interactions": [
            {
                "event_id": "s-i0",
                "turn": 0,
                "topic": "liverl.interactions.v1",
                "partition": 2,
                "offset": 40,
            },
            {
                "event_id": "s-i1",
                "turn": 1,
                "topic": "liverl.interactions.v1",
                "partition": 2,
                "offset": 41,
            },
        ],
    }
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
    return checker_of(
        gate_event("s", shlex.split(command) if command else [], GateResult(0, "", "", False, 1.0))
    ) | {"command": command}


def test_allowed_commands_are_whole_argv_patterns() -> None:
    assert TaskSettings().allowed_commands == []  # nothing by default
    with pytest.raises(click.UsageError, match="matches no pattern.*the list is empty"):
        allowed_argv(ran("rm -rf /tmp/x"), [])
    tests = ["pytest -q 'tests/*'"]  # one glob per argument
    assert allowed_argv(ran("pytest -q 'tests/a b.py'"), tests) == ["pytest", "-q", "tests/a b.py"]
    for other in (
        "pytest -q tests/a.py -p evil",
        "pytest tests/a.py",
        "pytest -q src/a.py",
        "rm -rf /tmp/x",
        "pytest -q",
    ):
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
        "pytest -q 'tests/*'"
    ]


def test_tasks_check_refuses_a_command_not_allowed_and_runs_one_that_is(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path,  # type: ignore[no-untyped-def]
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
    monkeypatch: pytest.MonkeyPatch,
    tmp_path,  # type: ignore[no-untyped-def]
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
    res = CliRunner().invoke(
        cli,
        [
            "tasks",
            "check",
            task.task_id,
            "--command",
            shlex.join([sys.executable, "-c", f"open({str(mine)!r}, 'w').write('y')"]),
        ],
        env=env,
    )
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
    labelled = gate_event(
        "s", ["pytest", "-q"], GateResult(0, "", "", False, 1.0), source="terminal"
    )
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


@pytest.mark.parametrize(
    ("answer", "votes", "status", "why"),
    [
        ("Fixed the import; the tests pass now.", [1, 1, 1], "accepted", "well-formed"),
        ("1.1.1.1.1.1.1.1.1.1", [-1, -1, 1], "rejected", "degenerate"),
        ("Fix the import error.", [-1, -1, 1], "rejected", "repeats the request"),
        ("I'm sorry, but I can't help with that.", [-1, -1, 1], "rejected", "a refusal"),
        # fluent but off the request's topic: one answer judge objects, the checker's vote stands
        ("The weather in Paris is lovely in spring.", [1, -1, 1], "accepted", "well-formed"),
    ],
)
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


# ---- verified tasks that stay verified (issue 38 item 8) -------------------------------------


def versioned(sid: str, t: int, version: int) -> Interaction:
    return dataclasses.replace(turn(sid, t, f"answer {t}"), weight_version=version)


def test_a_session_that_passes_fails_then_passes_is_one_task_withdrawn_by_the_failure() -> None:
    judges = build_judges(["word-a", "word-b", "word-c"], WORDS, PLUGINS)
    inters = [(dataclasses.replace(versioned("s", 0, 3), response_text="fixed the tests"), None)]
    sequence = [
        outcome_event("s", True, ts_ms=1),
        outcome_event("s", False, ts_ms=2),
        outcome_event("s", True, ts_ms=3),
    ]
    (batch,) = TaskJoin().feed(inters, [(o, None) for o in sequence])
    assert [r["vote"] for r in batch.record] == [1, -1, 1] and batch.withdrawn
    task = decide(batch, judges)
    assert (task.task_id, task.status) == (task_id("s", sequence[0].event_id), "withdrawn")
    assert [o["outcome_id"] for o in task.outcomes] == [o.event_id for o in sequence]
    assert events.decode(events.encode(task)) == task  # the schema takes status and outcomes
    # live, one outcome at a time: the same one task, published accepted, then revised
    j = TaskJoin()
    j.interaction(inters[0][0])
    (first,) = j.outcome(sequence[0])
    accepted = decide(first, judges)
    assert accepted.status == "accepted" and accepted.outcomes[0]["weight_version"] == 3
    (failed,) = j.outcome(sequence[1])
    withdrawn = revise(accepted, failed)
    assert (withdrawn.task_id, withdrawn.status) == (accepted.task_id, "withdrawn")
    assert withdrawn.votes == accepted.votes and withdrawn.event_id != accepted.event_id
    (again,) = j.outcome(sequence[2])
    final = revise(withdrawn, again)
    assert final.status == "withdrawn" and final.parents == task.parents
    assert revise(final, again) is final  # nothing since: not published again
    # a failure before the first pass is the work the pass fixed: it marks nothing
    j2 = TaskJoin()
    j2.interaction(inters[0][0])
    assert j2.outcome(outcome_event("s", False, ts_ms=1)) == []
    (c,) = j2.outcome(outcome_event("s", True, ts_ms=2))
    assert not c.withdrawn and decide(c, judges).status == "accepted"


def test_a_tasks_success_rate_is_that_of_the_newest_policy_version() -> None:
    j = TaskJoin()
    for t, version in ((0, 1), (1, 2), (2, 2)):
        j.interaction(versioned("r", t, version))
    outs = [
        outcome_event("r", True, turn=0, ts_ms=1),  # verifies: weights 1
        outcome_event("r", False, turn=1, ts_ms=2),  # weights 2
        outcome_event("r", True, turn=2, ts_ms=3),  # weights 2
        outcome_event("r", True, ts_ms=4),
    ]  # the session: its last turn, weights 2
    cs = [c for o in outs for c in j.outcome(o)]
    task = dataclasses.replace(_task("pytest -q"), outcomes=list(cs[-1].record))
    assert [o["weight_version"] for o in task.outcomes] == [1, 2, 2, 2]
    # under weights 2: 2 passed of 3 (the pass under weights 1 is another policy's)
    assert success_rate(task) == {
        "policy_id": BASE.policy_id,
        "weight_version": 2,
        "passed": 2,
        "failed": 1,
        "rate": 2 / 3,
    }
    assert success_rate(_task("pytest -q"))["rate"] is None  # an older task keeps none


def _git(repo: object, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.email=t@example.com", "-c", "user.name=t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def test_tasks_check_runs_in_the_recorded_workspace_at_its_commit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The gate passed at commit A in repo/sub; the checkout has moved on to B, where it
    fails. check runs it at A in a temporary worktree, leaving the checkout as it is."""
    from pipeline.cli import cli
    from pipeline.processors import task_commands

    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    _git(repo, "init", "-q")
    flag = repo / "sub" / "flag.txt"
    flag.write_text("pass")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "A")
    a = _git(repo, "rev-parse", "HEAD")
    flag.write_text("fail")
    _git(repo, "commit", "-q", "-am", "B")
    b = _git(repo, "rev-parse", "HEAD")
    gate = shlex.join(
        [
            sys.executable,
            "-c",
            "import pathlib, sys; sys.exit(pathlib.Path('flag.txt').read_text() != 'pass')",
        ]
    )
    recorded = {"dir": str(repo / "sub"), "commit": a}
    task = dataclasses.replace(_task(gate), checker={**_task(gate).checker, "workspace": recorded})
    monkeypatch.setattr(task_commands, "_pool", lambda settings, ns: {task.task_id: task})
    env = {
        "LIVERL_STATE_DIR": str(tmp_path / "state"),
        "LIVERL_TASKS_ALLOWED_COMMANDS": json.dumps([shlex.join([sys.executable, "-c", "*"])]),
    }
    res = CliRunner().invoke(cli, ["tasks", "check", task.task_id], env=env)
    assert res.exit_code == 0 and "in a temporary worktree" in res.output, res.output
    assert f"{task.task_id}: passed" in res.output
    assert _git(repo, "rev-parse", "HEAD") == b and flag.read_text() == "fail"  # untouched
    assert _git(repo, "status", "--porcelain") == ""
    assert len(_git(repo, "worktree", "list").splitlines()) == 1  # the temporary one gone
    # recorded at B, where the directory is: it runs there, and fails
    task.checker["workspace"] = {"dir": str(repo / "sub"), "commit": b}
    res = CliRunner().invoke(cli, ["tasks", "check", task.task_id], env=env)
    assert res.exit_code == 1 and f"in {repo / 'sub'} at {b[:12]}" in res.output, res.output
    # none recorded: said, and run here
    del task.checker["workspace"]
    monkeypatch.chdir(repo / "sub")
    res = CliRunner().invoke(cli, ["tasks", "check", task.task_id], env=env)
    assert res.exit_code == 1 and "no recorded workspace" in res.output, res.output
    # a timeout is no outcome (exit 124), not a failure
    slow = shlex.join([sys.executable, "-c", "import time; time.sleep(30)"])
    task.checker["command"] = slow
    res = CliRunner().invoke(cli, ["tasks", "check", task.task_id, "--timeout", "0.5"], env=env)
    assert res.exit_code == 124 and "no outcome" in res.output, res.output


def test_a_gate_records_where_it_ran_and_the_task_keeps_it(tmp_path: Path) -> None:
    from pipeline.processors.outcomes import workspace_of

    _git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("x")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "one")
    here = workspace_of(tmp_path)
    assert here == {"dir": str(tmp_path.resolve()), "commit": _git(tmp_path, "rev-parse", "HEAD")}
    outside = tmp_path.parent / "plain"
    outside.mkdir()
    assert workspace_of(outside)["commit"] is None
    ev = gate_event("s", ["pytest", "-q"], GateResult(0, "", "", False, 1.0), workspace=here)
    assert checker_of(ev)["workspace"] == here
